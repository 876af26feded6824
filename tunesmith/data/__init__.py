"""Data: tokenizer and chat templates, datasets, collate, packing."""

# Tokenizer and chat templates
from tunesmith.data.chat_template import (
    TEMPLATE_NAMES,
    RenderedChat,
    load_template,
    render,
    render_chat,
)
from tunesmith.data.tokenizer import Tokenizer

__all__ = [
    # Tokenizer and chat templates
    "TEMPLATE_NAMES",
    "RenderedChat",
    "Tokenizer",
    "load_template",
    "render",
    "render_chat",
]

# Datasets, labels, packing and collate
from tunesmith.data.collate import (  # noqa: E402
    collate_packed,
    collate_padded,
    collate_preference,
)
from tunesmith.data.formats import FORMATS, convert_row  # noqa: E402
from tunesmith.data.labels import IGNORE_INDEX, make_labels  # noqa: E402
from tunesmith.data.mix import DatasetMix, MixReport  # noqa: E402
from tunesmith.data.packing import PackedDataset, pack_greedy, packed_or_padded  # noqa: E402
from tunesmith.data.preference_dataset import PreferenceDataset, RawPreferencePair  # noqa: E402
from tunesmith.data.report import BadRowError, DataError, DataReport  # noqa: E402
from tunesmith.data.sft_dataset import SFTDataset  # noqa: E402
from tunesmith.data.validation import split_train_val  # noqa: E402

__all__ += [
    # Datasets, labels, packing and collate
    "FORMATS",
    "IGNORE_INDEX",
    "BadRowError",
    "DataError",
    "DataReport",
    "DatasetMix",
    "MixReport",
    "PackedDataset",
    "packed_or_padded",
    "PreferenceDataset",
    "RawPreferencePair",
    "SFTDataset",
    "collate_packed",
    "collate_padded",
    "collate_preference",
    "convert_row",
    "make_labels",
    "pack_greedy",
    "split_train_val",
]

"""The model families, one file each: importing this package imports (and so registers) every
family file in it. Adding a family is adding a file here (and its chat template).

Example::

    >>> from tunesmith.models import zoo
    >>> zoo.FAMILY_FILES["qwen3"].FAMILY.model_type
    'qwen3'
"""

import importlib
import pkgutil
from types import ModuleType

FAMILY_FILES: dict[str, ModuleType] = {
    info.name: importlib.import_module(f"{__name__}.{info.name}")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name)
}
"""Each family file's module by its name (``"qwen3"``), so ``tunesmith.models.qwen3`` works."""

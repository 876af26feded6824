"""Old path of :mod:`tunesmith.modules.losses.preference`, kept so that configs written before
the losses moved into one package (``_component_: tunesmith.modules.preference_losses.DPOLoss``,
and the config each checkpoint stores) still build the same classes. New code and configs use
``tunesmith.modules.losses``.
"""

from tunesmith.modules.losses.preference import *  # noqa: F403 (the same names, the same objects)
from tunesmith.modules.losses.preference import __all__  # noqa: F401

"""Old path of :mod:`tunesmith.modules.losses.kd`, kept so that configs written before the
losses moved into one package (``_component_: tunesmith.modules.kd_losses.KDLoss``, and the
config each checkpoint stores) still build the same classes. New code and configs use
``tunesmith.modules.losses``.
"""

from tunesmith.modules.losses.kd import *  # noqa: F403 (the same names, the same objects)
from tunesmith.modules.losses.kd import __all__  # noqa: F401

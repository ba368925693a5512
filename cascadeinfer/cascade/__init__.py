"""Multi-level cascade attention: plan once on the host, run many times on the device;
:func:`group_levels` cuts an engine's decode rows into levels from their page lists."""

from cascadeinfer.cascade.grouping import group_levels
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention
from cascadeinfer.cascade.plan import HostLevel

__all__ = ["HostLevel", "MultiLevelCascadeAttention", "group_levels"]

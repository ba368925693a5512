"""Multi-level cascade attention: plan once on the host, run many times on the device."""

from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention

__all__ = ["MultiLevelCascadeAttention"]

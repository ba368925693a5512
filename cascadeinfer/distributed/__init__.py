"""Attention states across processes, over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

A request's keys cut across ranks give one attention state per rank; merging the states
is exact (DESIGN.md, "The math"), so a context too long for one device is split by pages
and merged with :func:`merge_states_across`.
"""

from cascadeinfer.distributed.merge import merge_states_across

__all__ = ["merge_states_across"]

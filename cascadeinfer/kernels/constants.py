"""The constants of the base change, spelled once for every kernel and launcher.

Kernels keep scores in base 2 (``exp2``/``log2``, with ``log2(e)`` folded into the softmax
scale on the host) and store the natural-log LSE of the package's contract
(docs/DESIGN.md): multiply a natural-log quantity by ``LOG2E`` to enter base 2, a base-2
one by ``LN2`` to leave it. A global that a ``@triton.jit`` function reads must be a
``tl.constexpr``, hence the ``KERNEL_`` twins of the host floats.
"""

import math

import triton.language as tl

LOG2E = math.log2(math.e)  # 1.4426950408889634
LN2 = math.log(2.0)  # 0.6931471805599453
KERNEL_LOG2E = tl.constexpr(LOG2E)
KERNEL_LN2 = tl.constexpr(LN2)

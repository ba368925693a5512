#!/usr/bin/env bash
# On a GPU machine without internet: build FlashAttention-3 (its hopper/ package) from a
# source archive and install it into SITE, for the transformers peer of `cascadeinfer bench`
# (`--modes hf`): transformers' continuous batching switches from sdpa to FlashAttention-3
# when `flash_attn_interface` is installed, and without it runs every step under a dense
# mask over all requests' keys (benchmarks/NOTES.md, "Engine").
#
#   bash benchmarks/build_flash_attn3.sh [SITE]      # default SITE: /tmp/site
#   FA3_PACK=PATH.tar.xz bash benchmarks/build_flash_attn3.sh [SITE]     # also pack what it installed
#   FA3_PREBUILT=PATH.tar.xz bash benchmarks/build_flash_attn3.sh [SITE] # unpack an earlier pack instead
#
# Reads .peers/fa3/: flash-attention-3-src-*.tar.xz (flash-attention/hopper/ and the
# csrc/cutlass/include/ of the CUTLASS commit it pins) and the wheels the build needs
# (ninja, wheel, setuptools, packaging, einops). Only what the peer runs is compiled: the
# forward pass, bf16, head_dim 128, sm_90a, with paged KV, KV splits, packed GQA, varlen and
# appended KV (transformers' `flash_attn_with_kvcache` decode path writes the new K/V).
# Prints the build time, then checks the installed kernel against PyTorch's SDPA. A pack
# (FA3_PACK) holds the installed files alone (25 MB, 2.7 MB compressed); it runs only where
# the same torch and CUDA versions are installed, which the SDPA check below confirms.
set -eu
SITE="${1:-/tmp/site}"

build() {
  local src work=/tmp/fa3build start
  src=$(ls .peers/fa3/flash-attention-3-src-*.tar.xz 2>/dev/null | head -1)
  if [ -z "$src" ]; then echo "build_flash_attn3: no .peers/fa3/flash-attention-3-src-*.tar.xz" >&2; exit 2; fi
  rm -rf "$work"
  mkdir -p "$work/tools" "$SITE"
  tar -xJf "$src" -C "$work"
  python3 -m pip install -q --no-index --no-deps --target "$work/tools" .peers/fa3/*.whl
  export PYTHONPATH="$work/tools${PYTHONPATH:+:$PYTHONPATH}" PATH="$work/tools/bin:$PATH"
  export FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-$(nproc)}" NVCC_THREADS="${NVCC_THREADS:-2}"
  for feature in BACKWARD FP16 FP8 SM80 LOCAL SOFTCAP CLUSTER HDIM64 HDIM96 HDIM192 HDIM256 HDIMDIFF64 HDIMDIFF192; do
    export "FLASH_ATTENTION_DISABLE_$feature=TRUE"
  done
  start=$(date +%s)
  (cd "$work/flash-attention/hopper" &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .)
  echo "build_flash_attn3: built and installed into $SITE in $(( $(date +%s) - start )) s"
  if [ -n "${FA3_PACK:-}" ]; then
    tar -C "$SITE" -cJf "$FA3_PACK" flash_attn_3 flash_attn_3-*.dist-info flash_attn_interface.py flash_attn_config.py
    echo "build_flash_attn3: packed into $FA3_PACK"
  fi
}

if [ -n "${FA3_PREBUILT:-}" ]; then
  mkdir -p "$SITE"
  tar -xJf "$FA3_PREBUILT" -C "$SITE"
  echo "build_flash_attn3: unpacked $FA3_PREBUILT into $SITE"
else
  build
fi
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'EOF'
import torch
import torch.nn.functional as F
from flash_attn_interface import flash_attn_func

torch.manual_seed(0)
q, k, v = (torch.randn(2, 300, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32, 8, 8))
out = flash_attn_func(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     is_causal=True, enable_gqa=True).transpose(1, 2)
err = (out.float() - ref.float()).abs().max().item()
print(f"build_flash_attn3: flash_attn_func against SDPA, max abs error {err:.2e}")
assert err < 2e-2, err
EOF

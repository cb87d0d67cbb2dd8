# Source this on a GPU machine before running a binary of this workspace (cudarc loads CUDA libraries by
# name at run time): `source scripts/cuda-env.sh` (`scripts/gpu-tests.sh pack` copies it to .gpu/).
# It puts the directories of libcuda, NVRTC, cuBLAS(Lt), NCCL and the CUDA runtime on LD_LIBRARY_PATH,
# wherever the driver, the CUDA toolkit or Python wheels (PyTorch's NVIDIA packages) installed them.
# cudarc opens "libnccl.so", but the NCCL wheel ships only "libnccl.so.2": a link to it is made in a
# scratch directory put first on the path. Safe to source from a script running with `set -euo pipefail`.
_links=${TMPDIR:-/tmp}/fp8-fsdp-cuda-libs
mkdir -p "$_links"
_dirs=""
for _name in libcuda.so.1 libnvrtc.so.13 libnvrtc-builtins.so.13.0 libcublasLt.so.13 libcublas.so.13 libnccl.so.2 libcudart.so.13; do
  _p=$(find /usr/local/nvidia /usr/local/cuda /usr/local/cuda-13.0 /opt /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib \
    -name "$_name" -not -path '*/stubs/*' 2>/dev/null | head -n 1 || true)
  if [ -n "$_p" ]; then
    _d=$(dirname "$_p")
    case ":$_dirs:" in *":$_d:"*) ;; *) _dirs="$_dirs:$_d" ;; esac
    if [ "$_name" = libnccl.so.2 ]; then ln -sf "$_p" "$_links/libnccl.so"; fi
  else
    echo "cuda-env: $_name not found" >&2
  fi
done
export LD_LIBRARY_PATH="$_links${_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _links _dirs _name _p _d

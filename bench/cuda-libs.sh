#!/usr/bin/env bash
# Sourced by bench/run.sh on a GPU machine: puts the CUDA 13 libraries that the binaries load at run time
# (cudarc's dynamic loading) on LD_LIBRARY_PATH, wherever the driver, a CUDA toolkit or PyTorch's NVIDIA
# wheels installed them. cudarc opens "libnccl.so", which the NCCL wheel ships only as "libnccl.so.2": a link
# named libnccl.so is made in a private folder.
bench_cuda_link_dir=/tmp/bench-cuda-links
mkdir -p "$bench_cuda_link_dir"
bench_cuda_dirs=""
bench_cuda_roots="/usr/local/nvidia /usr/local/cuda /usr/local/cuda-13.0 /usr/lib/x86_64-linux-gnu /opt"
# The site-packages folder that holds PyTorch also holds the nvidia-* wheels' libraries (NCCL among them);
# found without importing torch. /usr/local last, for whatever the roots above missed.
bench_cuda_site=$(python3 -c 'import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else "")' 2>/dev/null || true)
[ -n "$bench_cuda_site" ] && [ -d "$bench_cuda_site/nvidia" ] && bench_cuda_roots="$bench_cuda_roots $bench_cuda_site/nvidia"
bench_cuda_roots="$bench_cuda_roots /usr/local"
for bench_cuda_lib in libcuda.so.1 libnvrtc.so.13 libnvrtc-builtins.so.13.0 libcublasLt.so.13 libcublas.so.13 \
    libnccl.so.2 libcudart.so.13; do
  # shellcheck disable=SC2086 # the roots are a word list on purpose
  bench_cuda_path=$(find $bench_cuda_roots -name "$bench_cuda_lib" -not -path '*/stubs/*' 2>/dev/null | head -n 1)
  if [ -z "$bench_cuda_path" ]; then
    echo "cuda-libs: $bench_cuda_lib not found" >&2
    continue
  fi
  bench_cuda_dir=$(dirname "$bench_cuda_path")
  case ":$bench_cuda_dirs:" in
    *":$bench_cuda_dir:"*) ;;
    *) bench_cuda_dirs="$bench_cuda_dirs:$bench_cuda_dir" ;;
  esac
  if [ "$bench_cuda_lib" = libnccl.so.2 ]; then
    ln -sf "$bench_cuda_path" "$bench_cuda_link_dir/libnccl.so"
  fi
done
export LD_LIBRARY_PATH="$bench_cuda_link_dir$bench_cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset bench_cuda_link_dir bench_cuda_dirs bench_cuda_roots bench_cuda_site bench_cuda_lib bench_cuda_path bench_cuda_dir

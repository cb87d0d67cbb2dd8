"""The timing-only builds of call 2 (their gradients are wrong by design): run from the repository root at
6aa3515's parent with attention_wgmma.cu saved as /tmp/wgmma_orig.cu; each /tmp/eN.cu replaced
fp8-kernels/src/attention/attention_wgmma.cu for one `cargo build --release -p fp8-kernels --example
attention_bench`, copied to .gpu/bin/attention_bench_eN.
  e1: no turn wait (the writer reduces at once)
  e2: no dQ write (the writer frees the shared tile as soon as it is full)
  e3: no dQ products (the consumers store zeros)
  e4: e2 and e3
"""
src = open('/tmp/wgmma_orig.cu').read()
spin = """                    for (u32 polls = 0; att_ld_acquire_gpu(turn) != (u32)kb;)
                        if (++polls == (1u << 28)) att_trap();
"""
assert spin in src
open('/tmp/e1.cu', 'w').write(src.replace(spin, ""))
a = src.index("                if (lane == 0) {\n                    const u64 tile = ((u64)b * H + kvh * G + hh) * nqb + i;")
b = src.index("att_mbar_arrive(dq_empty);", a)
e2 = src[:a] + "                if (lane == 0) {\n                    " + src[b:]
open('/tmp/e2.cu', 'w').write(e2)
old = """                float dq[32];
                if (visible) {
                    att_wg_fence_regs<32>(dq);"""
assert old in src
open('/tmp/e3.cu', 'w').write(src.replace(old, old.replace("if (visible)", "if (visible && T < 0)")))
open('/tmp/e4.cu', 'w').write(e2.replace(old, old.replace("if (visible)", "if (visible && T < 0)")))

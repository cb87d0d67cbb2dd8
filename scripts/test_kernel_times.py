#!/usr/bin/env python3
"""CPU test of scripts/kernel_times.py on a hand-written Nsight Compute raw-page CSV (run by .ci/run)."""

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum"
"","","","","","","","","","","","usecond"
"0","1","lm","h","embedding_fwd_bf16_bf16","1","7","(256,1,1)","(8,1,1)","0","9.0","1.5"
"1","1","lm","h","void sm90_xmma_gemm_e4m3<int>(Params)","1","7","(256,1,1)","(8,1,1)","0","9.0","900"
"2","1","lm","h","embedding_fwd_bf16_bf16","1","7","(256,1,1)","(8,1,1)","0","9.0","2"
"3","1","lm","h","attn_fwd_wgmma_g2n128w_hd64","1","7","(384,1,1)","(8,1,1)","0","9.0","3,000"
"4","1","lm","h","void sm90_xmma_gemm_e4m3<float>(Params)","1","7","(256,1,1)","(8,1,1)","0","9.0","1000"
"5","1","lm","h","rmsnorm_fwd_e4m3","1","7","(256,1,1)","(8,1,1)","0","9.0","998"
==PROF== Disconnected
'''


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.csv")
        with open(path, "w") as f:
            f.write(CSV)
        out = subprocess.run([sys.executable, os.path.join(HERE, "kernel_times.py"), path],
                             check=True, capture_output=True, text=True).stdout
    # The last step starts at the second embedding launch: 4 launches, 2 + 3000 + 1000 + 998 us.
    assert "6 launches profiled, 2 steps; the last step: 4 launches, 5.000 ms" in out, out
    assert "| attention | 1 | 3.000 | 60.0 % |" in out, out
    # Both GEMM launches fold into one name once template arguments are dropped; the first step's is out.
    assert "| `sm90_xmma_gemm_e4m3` | 1 | 1.000 | 20.0 % |" in out, out
    assert "| norm (+cast) | 1 | 0.998 | 20.0 % |" in out, out
    print("kernel_times: ok")


if __name__ == "__main__":
    main()

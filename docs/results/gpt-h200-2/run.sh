#!/usr/bin/env bash
# GPU call G: ncu per-kernel figures of the LayerNorm and cross-entropy kernels; then gpt2 8x512 600-step
# fidelity runs (the gpt2 row's flags), seeds 3-4, six runs in parallel on the one GPU.
set -u
B=/tmp/b; mkdir -p $B && tar -C $B -xJf .gpuA/g.tar.xz
source $B/cuda-env.sh
mkdir -p /tmp/fid
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum,sm__inst_executed.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio
timeout 150 ncu --clock-control none --metrics $M -k regex:'ln_|cross_entropy' --launch-skip 0 --launch-count 60 --csv $B/layer_kernel_bench --iters 1 --chunks 8192 > /tmp/fid/ncu.csv 2> /tmp/fid/ncu.err; echo "ncu rc=$?" >> /tmp/fid/summary.txt
fid() { local name=$1; shift; timeout 200 $B/gpt_fsdp --device cuda --preset gpt2 --batch-size 8 --seq-len 512 --steps 600 --lr 6e-4 --data $B/shakespeare --no-progress --metrics /tmp/fid/$name.jsonl "$@" > /tmp/fid/$name.log 2>&1; echo "$name rc=$?" >> /tmp/fid/summary.txt; }
F="--precision fp8 --fp8-layers all --grad-shards bf16"
for s in 3 4; do
  fid fp8-s$s $F --seed $s &
  fid fp8comm-s$s $F --fp8-grad-comm --seed $s &
  fid bf16-s$s --precision bf16 --seed $s &
done
wait
tar -C /tmp/fid -czf $OUT/fid.tgz .
python3 - <<'PY'
import csv,collections
try:
    rows=list(csv.reader(open('/tmp/fid/ncu.csv')))
    h=None; agg=collections.OrderedDict()
    for r in rows:
        if 'Kernel Name' in r: h=r; continue
        if h is None or len(r)!=len(h): continue
        d=dict(zip(h,r)); k=(d['Kernel Name'][:40],d['Block Size'],d['Grid Size']); agg.setdefault(k,{})[d['Metric Name']]=d['Metric Value']
    for k,v in list(agg.items())[:30]:
        print(k, {m.split('__')[1][:22]:v[m] for m in v})
except Exception as e: print('ncu parse failed',e)
PY
tail -5 /tmp/fid/ncu.err
for f in /tmp/fid/*.log; do echo "$(basename $f): $(grep -E 'val loss' $f | tail -1)"; done
cat /tmp/fid/summary.txt

#!/bin/bash
# Call 14: where the ordered backward's time goes (timing-only builds, results wrong by design):
# e1 no turn wait; e2 no dQ write (sdQ freed at once); e3 no dQ products; e4 e2 + e3.
set +e
source .gpu/cuda-env.sh >/dev/null 2>&1
T0=$(date +%s)
for E in e1 e2 e3 e4; do for SH in 6 1; do
  timeout 45 .gpu/bin/attention_bench_$E --wgmma --shape $SH --iters 10 > $OUT/$E-$SH.log 2>&1
  echo "$E shape $SH rc=$? ($(( $(date +%s) - T0 )) s): $(sed -n '/^backward alone/,/^$/p' $OUT/$E-$SH.log | grep -E 'ordered' | cut -c1-70)"
done; done
echo "total $(( $(date +%s) - T0 )) s"

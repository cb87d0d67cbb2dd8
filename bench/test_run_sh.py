#!/usr/bin/env python3
"""CPU tests of bench/run.sh's GPU-side flow and its unpack step, with stand-ins for our binaries and the peer
scripts (they print the JSON lines the real ones print): the commands run, the results folder, the summary,
the time budget, the tarball and its extraction into docs/results/.

Run: python3 bench/test_run_sh.py   (or python3 -m unittest discover -s bench)
"""
import glob
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import unittest

BENCH = os.path.dirname(os.path.abspath(__file__))

FAKE_OURS = """#!/usr/bin/env bash
# stand-in for gpt_fsdp --speed: sleeps FAKE_SLEEP seconds, prints a table and the JSON line
sleep "${FAKE_SLEEP:-0}"
echo "| quantity | value |"
echo '{"impl":"fp8-fsdp","tokens_per_s":447100.0,"peak_GiB":5.39,"step_s":0.0366,"args":"'"$*"'"}'
"""

FAKE_PEER = """import json, os, sys
# stand-in for peer_gpt.py: figures by mode; the gpt-6.7b preset runs out of memory
mode, preset = sys.argv[2], sys.argv[3]
if preset == "gpt-6.7b":
    print(json.dumps({"mode": mode, "error": "OOM", "peak_GiB": 139.0}))
    sys.exit(3)
tokens = {"bf16": 318700.0, "fp8": 176900.0}[mode] * float(os.environ.get("FAKE_SCALE", "1"))
print(json.dumps({"mode": mode, "compile": os.environ.get("COMPILE") == "1", "tokens_per_s": tokens,
                  "peak_GiB": 15.3, "argv": sys.argv[1:]}))
"""


FAKE_LAYER_KERNEL_BENCH = """#!/usr/bin/env bash
# stand-in for layer_kernel_bench: with --peer FILE it reads the peer's JSON lines (as the real one does)
if [ "${1:-}" = --peer ]; then
  [ -f "$2" ] || { echo "error: --peer $2: missing"; exit 1; }
  echo "peer: $(grep -c '^{' "$2") records of peer_layers.py from $2"
fi
echo "LayerNorm + E4M3 + amax fwd [16384, 768]               18.00 µs   24.00 µs   0.75x  <=0.8x  notes"
"""

FAKE_PEER_LAYERS = """import json
# stand-in for peer_layers.py: a warning line, then the JSON records
print("UserWarning: something torch says")
print(json.dumps({"op": "layernorm_e4m3_fwd", "rows": 16384, "d": 768, "s": 24.0e-6, "GBps": 1572.8}))
"""


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def make_executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


class RunShell(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        root = self.root = os.path.join(self.tmp.name, "repo")
        os.makedirs(os.path.join(root, "bench"))
        for name in ("run.sh", "summarize.py", "cuda-libs.sh"):
            shutil.copy(os.path.join(BENCH, name), os.path.join(root, "bench", name))
        for sub in ("bin", "peers", "external"):
            os.makedirs(os.path.join(root, ".bench", sub))
        # Only gpt_fsdp is packed: the run falls back to it from lm_fsdp.
        make_executable(os.path.join(root, ".bench", "bin", "gpt_fsdp"), FAKE_OURS)
        with open(os.path.join(root, ".bench", "peers", "peer_gpt.py"), "w") as f:
            f.write(FAKE_PEER)
        with open(os.path.join(root, ".bench", "external", "peer_gpt.py"), "w") as f:
            f.write(FAKE_PEER.replace('os.environ.get("FAKE_SCALE", "1")', '"0.99"'))
        self.out = os.path.join(self.tmp.name, "out")

    def run_sh(self, *args, **env):
        full_env = dict(os.environ, OUT=self.out, BENCH_WORK=os.path.join(self.tmp.name, "work"))
        full_env.update(env)
        return subprocess.run(["bash", os.path.join(self.root, "bench", "run.sh"), *args], env=full_env,
                              capture_output=True, text=True, timeout=120)

    def tarball(self):
        found = glob.glob(os.path.join(self.out, "*.tar.gz"))
        self.assertEqual(len(found), 1, found)
        return found[0]

    def extracted(self, tar_path):
        dest = os.path.join(self.tmp.name, "x")
        with tarfile.open(tar_path) as t:
            t.extractall(dest, filter="data")
        (folder,) = os.listdir(dest)
        return os.path.join(dest, folder)

    def test_rows_run_ours_then_each_peer_beside_the_external_one(self):
        r = self.run_sh("gpt", "gpt2,gpt-6.7b")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        tar_path = self.tarball()
        self.assertRegex(os.path.basename(tar_path), r"^\d{4}-\d\d-\d\d-\d{4}-gpt-gpt2-gpt-6\.7b\.tar\.gz$")
        folder = self.extracted(tar_path)
        for name in ("runs.tsv", "commands.sh", "env.txt", "summary.md", "gpt2.ours.log", "gpt2.peer-bf16.log",
                     "gpt2.ext-bf16.log", "gpt2.peer-fp8.log", "gpt2.ext-fp8.log", "gpt-6.7b.ours.log",
                     "gpt-6.7b.peer-bf16.log"):
            self.assertTrue(os.path.isfile(os.path.join(folder, name)), name)
        commands = read(os.path.join(folder, "commands.sh")).splitlines()[2:]
        self.assertEqual(commands, [
            ".bench/bin/gpt_fsdp --speed --device cuda --preset gpt2 --batch-size 16 --seq-len 1024 --grad-shards bf16",
            "env COMPILE=1 python3 .bench/peers/peer_gpt.py speed bf16 gpt2 16 1024",
            "env COMPILE=1 python3 .bench/external/peer_gpt.py speed bf16 gpt2 16 1024",
            "env COMPILE=1 python3 .bench/peers/peer_gpt.py speed fp8 gpt2 16 1024",
            "env COMPILE=1 python3 .bench/external/peer_gpt.py speed fp8 gpt2 16 1024",
            ".bench/bin/gpt_fsdp --speed --device cuda --d-model 4096 --layers 32 --heads 32 --batch-size 1 "
            "--seq-len 8192 --grad-shards bf16",
            "env COMPILE=1 python3 .bench/peers/peer_gpt.py speed bf16 gpt-6.7b 1 8192",
        ])
        summary = read(os.path.join(folder, "summary.md"))
        self.assertIn("| gpt2, 16 x 1024 | 447.1k tok/s, 5.39 GiB | 318.7k tok/s, 15.30 GiB | "
                      "176.9k tok/s, 15.30 GiB | 1.40x (PyTorch BF16) | 0.35x |", summary)
        self.assertIn("| gpt-6.7b, 1 x 8192 | 447.1k tok/s, 5.39 GiB | out of memory |", summary)
        self.assertIn("| 1.010 | yes |", summary)   # ours-written / external = 1 / 0.99
        self.assertIn(summary.strip().splitlines()[0], r.stdout)   # the summary is printed too
        rcs = [l.split("\t")[5] for l in read(os.path.join(folder, "runs.tsv")).splitlines()[1:]]
        self.assertEqual(rcs, ["0", "0", "0", "0", "0", "0", "3"])

        # unpack puts the folder into docs/results/ once
        u = self.run_sh("unpack", tar_path)
        self.assertEqual(u.returncode, 0, u.stderr)
        name = os.path.basename(tar_path)[:-len(".tar.gz")]
        self.assertTrue(os.path.isfile(os.path.join(self.root, "docs", "results", name, "summary.md")))
        again = self.run_sh("unpack", tar_path)
        self.assertEqual(again.returncode, 2)
        self.assertIn("exists", again.stderr)

    def test_layers_runs_the_peer_first_and_hands_its_log_to_ours(self):
        bins = os.path.join(self.root, ".bench", "bin")
        make_executable(os.path.join(bins, "layer_kernel_bench"), FAKE_LAYER_KERNEL_BENCH)
        make_executable(os.path.join(bins, "attention_bench"), "#!/usr/bin/env bash\necho attention\n")
        make_executable(os.path.join(bins, "lm_head_bench"), "#!/usr/bin/env bash\necho head\n")
        with open(os.path.join(self.root, ".bench", "peers", "peer_layers.py"), "w") as f:
            f.write(FAKE_PEER_LAYERS)
        r = self.run_sh("layers", BENCH_EXTERNAL="none")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        folder = self.extracted(self.tarball())
        commands = read(os.path.join(folder, "commands.sh")).splitlines()[2:]
        self.assertEqual(len(commands), 4, commands)
        self.assertEqual(commands[0], "env python3 .bench/peers/peer_layers.py")
        self.assertRegex(commands[1], r"^\.bench/bin/layer_kernel_bench --peer \S*/layers\.peer-layers\.log$")
        self.assertRegex(commands[2], r"^\.bench/bin/attention_bench --peer \S*/layers\.peer-layers\.log$")
        self.assertRegex(commands[3], r"^\.bench/bin/lm_head_bench --peer \S*/layers\.peer-layers\.log$")
        ours = read(os.path.join(folder, "layers.ours-layer_kernel_bench.log"))
        self.assertIn("peer: 1 records of peer_layers.py", ours)
        summary = read(os.path.join(folder, "summary.md"))
        self.assertIn("| LayerNorm + E4M3 + amax fwd [16384, 768] | 18.0 µs | 24.0 µs | 0.75x |", summary)

    def test_the_budget_skips_what_no_longer_fits(self):
        # 60 s budget, 15 s kept for the tarball, a run needs 20 s: ours (28 s) starts with 45 s less the setup
        # left, after it less than 17 s are left.
        r = self.run_sh("gpt", "gpt2", BENCH_BUDGET_S="60", FAKE_SLEEP="28")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        folder = self.extracted(self.tarball())
        runs = [l.split("\t") for l in read(os.path.join(folder, "runs.tsv")).splitlines()[1:]]
        self.assertEqual([(x[3], x[5]) for x in runs], [("ours", "0"), ("peer:bf16", "skip"), ("ext:bf16", "skip"),
                                                        ("peer:fp8", "skip"), ("ext:fp8", "skip")])
        self.assertIn("skipped (time budget)", read(os.path.join(folder, "summary.md")))

    def test_external_peers_can_be_turned_off_and_ours_flags_added(self):
        r = self.run_sh("gpt", "gpt2", BENCH_EXTERNAL="none", BENCH_OURS_FLAGS="--profile --seed 2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        folder = self.extracted(self.tarball())
        commands = read(os.path.join(folder, "commands.sh"))
        self.assertNotIn("external", commands)
        self.assertIn("--grad-shards bf16 --profile --seed 2\n", commands)

    def test_bad_arguments_and_a_missing_pack_are_refused(self):
        r = self.run_sh("gpt", "gpt5")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no row gpt5", r.stderr)
        r = self.run_sh("mlp")
        self.assertEqual(r.returncode, 2)
        self.assertIn("pack mlp", r.stderr)
        r = self.run_sh("nonsense")
        self.assertEqual(r.returncode, 2)
        self.assertIn("bench/run.sh pack NAME", r.stdout)   # the help
        self.assertFalse(os.path.exists(self.out))


if __name__ == "__main__":
    unittest.main()

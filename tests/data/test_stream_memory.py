"""A loader runs for weeks and reads a new shuffle window every few minutes: its memory must stay
bounded by the window cache (Stream's `cache` windows), however many windows it has read."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import megascale.data

CORPUS = Path(megascale.data.__file__).parent / "corpus" / "python_docs.jsonl"

# In a fresh process, so that the RSS is the stream's: the shipped corpus is one shard, one window of
# ~1.5 MB per epoch, so every epoch loads (and caches) a new window.
READ_EPOCHS = """
import json, sys
from megascale.data.dataset import Dataset
from megascale.data.prepare import prepare_cached
from megascale.data.stream import Stream

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

stream = Stream(Dataset(prepare_cached(sys.argv[1], sys.argv[2])), seed=0, window=8)
rss = []
for epoch in range(40):
    stream.read(epoch * stream.epoch_tokens, 17 * 1024)
    rss.append(rss_mb())
print(json.dumps({"loaded": stream.loaded, "rss": rss}))
"""


def test_loader_memory_stays_bounded_by_its_window_cache(tmp_path):
    out = subprocess.run([sys.executable, "-c", READ_EPOCHS, str(CORPUS), str(tmp_path)], capture_output=True,
                         text=True, check=True)
    result = json.loads(out.stdout)
    assert result["loaded"] == 40
    rss = result["rss"]
    # Measured: +6 MB while the first ~6 windows fill the cache (3 windows) and glibc's heap, then flat to the
    # 0.1 MB over the next 34 windows. A window kept per load would add ~1.5 MB each: 50 MB here.
    assert max(rss[10:]) - rss[10] < 3.0, rss

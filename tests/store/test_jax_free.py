"""``jdist.store`` and ``jdist.errors`` (floor 0) and the launcher load without JAX."""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import sys
for name in ("jax", "jaxlib", "flax"):
    sys.modules[name] = None  # any import of them now raises ImportError
import jdist.errors, jdist.store, jdist.launch.__main__
s = jdist.store.HashStore()
s.set("k", "v")
assert s.get("k") == b"v"
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax")
                and sys.modules[m] is not None)
assert not loaded, loaded
print("ok")
"""


def test_store_errors_and_launcher_import_without_jax():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

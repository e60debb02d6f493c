"""The runtime is what a serving box installs: torch, safetensors, triton and tokenizers only.

A fresh interpreter imports kvcalib_runtime, loads a converted checkpoint and generates from it;
none of kvcalib, transformers, scipy or click may be imported on the way (the runtime's
dependency rule, ARCHITECTURE.md), and `import kvcalib_runtime` alone does not import triton (the
kernels load with the first quantized cache), which keeps it cheap.
"""

import json
import subprocess
import sys

from support.tiny import save_with_tokenizer, tiny_model

from kvcalib import convert

FORBIDDEN = ("click", "kvcalib", "scipy", "transformers")
SCRIPT = """
import json, sys
import kvcalib_runtime
cheap = "triton" not in sys.modules
model = kvcalib_runtime.load(sys.argv[1], device="cpu")
[new] = model.generate("Hello", 4, eos_token_id=[])
top = {name.split(".")[0] for name in sys.modules}
print(json.dumps({"cheap": cheap, "imported": sorted(top & set(sys.argv[2:])), "new": len(new)}))
"""


def test_loading_and_generating_imports_only_the_runtime_dependencies(tmp_path):
    source = tmp_path / "source"
    save_with_tokenizer(tiny_model("llama"), source)
    folder = convert(source, recipe="quarot-kv4", output=tmp_path / "converted")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), *FORBIDDEN],
        cwd=tmp_path,  # nothing importable from the working directory
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"cheap": True, "imported": [], "new": 4}

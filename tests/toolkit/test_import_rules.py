"""The toolkit's dependency rule (ARCHITECTURE.md), read from the source: shared contracts are
leaves (errors <- io <- core), the simulator sits on them, and the stages — calibration, conversion,
evaluation — never import each other; only the top (api, cli, inspect, generate, the package's
lazy exports) sees everything. Library modules import at the top of the file; the CLI defers its
imports so `kvcalib --help` answers fast, and an optional dependency may be imported where it is
needed, with its ImportError turned into a message."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvcalib

ROOT = Path(kvcalib.__file__).parent
LAYERS = {
    "errors": set(),
    "io": {"errors"},
    "core": {"errors", "io"},
    "sim": {"errors", "io", "core"},
    "calibration": {"errors", "io", "core", "sim"},
    "conversion": {"errors", "io", "core", "sim"},
    "evaluation": {"errors", "io", "core", "sim"},
}
TOP = {"api", "cli", "inspect", "generate", "lmeval", "lmeval_args", "__init__"}
DEFERRED = {
    "cli.py": None,
    "core/models.py": {"gguf", "transformers"},  # loading a model; resolving a folder: neither
    "core/hub.py": {"huggingface_hub", "huggingface_hub.errors"},  # a hub id only
    "evaluation/external.py": {"optimum.quanto"},
    "api.py": {  # the stages convert does not need: imported where used
        "kvcalib.calibration",
        "kvcalib.calibration.codebooks",
        "kvcalib.evaluation",
        "kvcalib.evaluation.score",
    },
}


def _layer(path: Path) -> str:
    part = path.relative_to(ROOT).parts[0]
    return part.removesuffix(".py")


def _modules():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name


def test_stages_never_import_each_other():
    broken = []
    for path in _modules():
        layer = _layer(path)
        if layer in TOP:
            continue
        allowed = LAYERS[layer] | {layer}
        for _, name in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            if parts[0] == "kvcalib" and len(parts) > 1 and parts[1] not in allowed:
                broken.append(f"{path.relative_to(ROOT)} imports {name}")
    assert broken == []


def test_library_modules_import_at_the_top():
    nested = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        allowed = DEFERRED.get(rel, set())
        for node, name in _imports(tree):
            if id(node) in top or allowed is None or name in allowed:
                continue
            nested.append(f"{rel}:{node.lineno} imports {name} inside a function")
    assert nested == []


HELP = """
import sys, time
start = time.process_time()
from kvcalib.cli import main
main(["--help"], standalone_mode=False)
print("torch" in sys.modules, time.process_time() - start)
"""


def test_help_answers_within_a_second():
    """`kvcalib --help` imports neither torch nor transformers (lazy package exports): it
    answers in well under a second (measured in a fresh interpreter, its own start aside, in
    CPU seconds: on a loaded machine the wall clock measures the other jobs)."""
    result = subprocess.run(
        [sys.executable, "-c", HELP], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    torch_loaded, seconds = result.stdout.split()[-2:]
    assert torch_loaded == "False" and float(seconds) < 1.0


CONVERT_IMPORTS = """
import sys
import kvcalib.api
print(sorted(m for m in ("transformers", "gguf", "torch._dynamo", "sympy") if m in sys.modules))
"""


def test_convert_imports_no_model_loader():
    """`kvcalib convert` of a local folder reads safetensors and writes safetensors: the API's
    import brings neither transformers and gguf (model loading, imported where a model loads:
    about a second) nor torch's compiler stack (torch._dynamo, sympy: 2-4 s)."""
    result = subprocess.run(
        [sys.executable, "-c", CONVERT_IMPORTS], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


MISSING = """
import sys
from kvcalib.cli import main
try:
    main(sys.argv[1:], prog_name="kvcalib")
except SystemExit as e:
    print(e.code, "torch" in sys.modules, "transformers" in sys.modules)
"""


@pytest.mark.parametrize(
    "args, message",
    [
        (["calibrate", "{x}/model", "-o", "{x}/p"], "model {x}/model: no such file or folder"),
        (["calibrate", "--data", "{x}/t.txt", "-o", "{x}/p"], "--data {x}/t.txt: no such file"),
        (["convert", "--recipe", "{x}/r.toml", "-o", "{x}/o"], "recipe {x}/r.toml: no such file"),
        (["convert", "--recipe", "fp16", "--profile", "{x}/p", "-o", "{x}/o"], "profile {x}/p:"),
        (["eval", "{x}/m", "--recipe", "fp16"], "model {x}/m: no such file or folder"),
        (["generate", "{x}/c", "--prompt", "hi"], "checkpoint {x}/c: no such file or folder"),
        (["inspect", "{x}/m"], "model {x}/m: no such file or folder"),
    ],
)
def test_a_missing_path_fails_before_torch_imports(args, message, tmp_path):
    """ "no such file" took tens of seconds: every command imported torch and transformers
    before it looked at its paths."""
    args = [a.format(x=tmp_path) for a in args]
    result = subprocess.run(
        [sys.executable, "-c", MISSING, *args], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert result.stderr.startswith(f"error: {message.format(x=tmp_path)}")


def test_only_the_layouts_compare_granularity_or_method():
    """A stored layout's behaviour lives in its own module (kvcalib_runtime/layouts/): nowhere
    else does code branch on a spec's or recipe's `granularity` or `method` string; it asks
    `spec.layout` (ARCHITECTURE.md), so a new layout is one new module."""
    import kvcalib_runtime

    runtime = Path(kvcalib_runtime.__file__).parent
    sources = [*_modules(), *runtime.rglob("*.py"), *(ROOT.parent / "benchmarks").glob("*.py")]
    found = []
    for path in sources:
        if "layouts" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(
                isinstance(s, ast.Attribute) and s.attr in ("granularity", "method") for s in sides
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def _layouts_graph() -> dict[str, set[str]]:
    """kvcalib_runtime/layouts/'s modules -> the modules of the package each imports, those
    under TYPE_CHECKING included ("__init__": the package itself, for a name it exports)."""
    import kvcalib_runtime

    package = Path(kvcalib_runtime.__file__).parent / "layouts"
    names = {p.stem for p in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        edges = set()
        for node, module in _imports(ast.parse(path.read_text())):
            if module == "kvcalib_runtime" and isinstance(node, ast.ImportFrom):
                edges |= {"__init__" for a in node.names if a.name == "layouts"}
            elif module == "kvcalib_runtime.layouts" and isinstance(node, ast.ImportFrom):
                edges |= {a.name if a.name in names else "__init__" for a in node.names}
            elif module.startswith("kvcalib_runtime.layouts."):
                edges.add(module.split(".")[2])
        graph[path.stem] = edges
    return graph


def test_layouts_have_no_import_circle():
    """The registry (layouts.base) and QuantSpec (layouts.spec) are leaves: base imports no
    module of the package, spec only base, and no module inside imports the package itself or
    closes a circle, not even under TYPE_CHECKING. A circle let spec.py read the package's
    tables at import time, half-initialised for the first layout that needs QuantSpec."""
    graph = _layouts_graph()
    assert graph["base"] == set() and graph["spec"] == {"base"}, (graph["base"], graph["spec"])
    inward = sorted(m for m, edges in graph.items() if m != "__init__" and "__init__" in edges)
    assert inward == [], inward
    done, path = set(), []

    def visit(m):
        assert m not in path, " -> ".join([*path[path.index(m) :], m])
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


BODIES = {"PackedBody", "CodeBody", "TurboBody", "ExactBody", "ROW_BODIES"}


def test_only_the_layouts_ask_a_body_its_class():
    """What a layout allocates is read through layouts.body's protocol (its tensors, per-token
    rows, stream arguments, reference read and writer): no code outside layouts/ asks a body
    which class it is (`isinstance` with a body class, or of anything named body), so a new
    layout's body needs no branch elsewhere."""
    import kvcalib_runtime

    runtime = Path(kvcalib_runtime.__file__).parent
    plugin = ROOT.parent / "vllm_plugin" / "kvcalib_vllm"
    sources = [*_modules(), *runtime.rglob("*.py"), *plugin.rglob("*.py")]
    sources += [*(ROOT.parent / "benchmarks").glob("*.py")]
    found = []
    for path in sources:
        if "layouts" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance"):
                continue
            what, classes = (ast.unparse(a) for a in node.args)
            if re.search(r"body\b", what) or BODIES & set(re.findall(r"\w+", classes)):
                found.append(f"{path.name}:{node.lineno} isinstance({what}, {classes})")
    assert not found, found

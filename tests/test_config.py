import os
import stat
from pathlib import Path

import pytest

from tandem.config import Config, ConfigError, describe_fields, dump_config, load_config, write_private

ROOT = Path(__file__).resolve().parent.parent
# Pipeline configs (pipeline-*.yaml) have their own schema: stages/pipeline.py, tests/test_pipeline.py.
SHIPPED = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("pipeline-"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # the resolved YAML round-trips to the same config
    again = load_config(None, raw=__import__("yaml").safe_load(dump_config(cfg)))
    assert again == cfg


def test_shipped_configs_cover_cpu_and_both_gpu_engines() -> None:
    engines = {load_config(p).rollout.engine for p in SHIPPED}
    assert "hf" in engines


def test_override_changes_nested_value_and_parses_types() -> None:
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        ["learner.total_steps=7", "rollout.temperature=0.5", "rollout.stop=[x, y]", "model.reference=null"],
    )
    assert cfg.learner.total_steps == 7
    assert cfg.rollout.temperature == 0.5
    assert cfg.rollout.stop == ["x", "y"]
    assert cfg.model.reference is None


def test_unknown_key_names_the_path() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.tempreature: unknown key"):
        load_config(ROOT / "configs/tiny.yaml", ["rollout.tempreature=0.5"])


def test_wrong_type_names_the_path_and_value() -> None:
    with pytest.raises(ConfigError, match=r"learner\.total_steps: .*integer.*'many'"):
        load_config(ROOT / "configs/tiny.yaml", ["learner.total_steps=many"])


def test_out_of_range_names_the_path_and_bound() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.top_p: Input should be less than or equal to 1"):
        load_config(ROOT / "configs/tiny.yaml", ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"algorithm\.max_staleness: .*greater than or equal to 0"):
        load_config(ROOT / "configs/tiny.yaml", ["algorithm.max_staleness=-1"])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_missing_required_section_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("data: {prompts: x.jsonl}\nreward: {functions: [{path: 'toy.tasks.echo:reward'}]}\n")
    with pytest.raises(ConfigError, match=r"model: Field required"):
        load_config(p)


def test_cross_field_check_names_both_fields() -> None:
    with pytest.raises(
        ConfigError, match=r"algorithm\.batch_size \(30\) must be a multiple of rollout\.n_samples \(8\)"
    ):
        load_config(ROOT / "configs/tiny.yaml", ["algorithm.batch_size=30"])


def test_sync_interval_beyond_the_staleness_bound_is_refused() -> None:
    tiny, s2 = ROOT / "configs/tiny.yaml", "algorithm.max_staleness=2"
    assert load_config(tiny, [s2, "algorithm.sync_interval=3"]).algorithm.sync_interval == 3
    with pytest.raises(
        ConfigError,
        match=r"^invalid config .*\n  algorithm\.sync_interval \(4\) must be <= max_staleness \+ 1 \(3\)",
    ):
        load_config(tiny, [s2, "algorithm.sync_interval=4"])
    with pytest.raises(
        ConfigError, match=r"algorithm\.sync_interval \(2\) must be <= max_staleness \+ 1 \(1; run\.mode=sync"
    ):
        load_config(tiny, [s2, "algorithm.sync_interval=2", "run.mode=sync"])


def test_an_own_critic_on_an_offline_recipe_is_a_config_error() -> None:
    """An offline recipe has no advantage estimator, so no critic: the check names the field, not an
    AttributeError from reading a ppo-only field."""
    with pytest.raises(ConfigError, match=r"placement\.critic=own needs a critic"):
        load_config(ROOT / "configs/sft-echo.yaml", ["placement.critic=own"])


def test_per_turn_credit_needs_a_per_token_estimator() -> None:
    tiny = ROOT / "configs/tiny.yaml"
    assert load_config(tiny, ["algorithm.credit=turn", "algorithm.advantage=gae"]).algorithm.credit == "turn"
    with pytest.raises(
        ConfigError, match=r"algorithm\.credit=turn .*algorithm\.advantage=grpo scores whole sequences"
    ):
        load_config(tiny, ["algorithm.credit=turn", "algorithm.advantage=grpo"])


def test_sync_mode_is_on_policy_whatever_the_configured_bound() -> None:
    tiny = ROOT / "configs/tiny.yaml"
    assert load_config(tiny, ["algorithm.max_staleness=2"]).max_staleness == 2
    assert load_config(tiny, ["algorithm.max_staleness=2", "run.mode=sync"]).max_staleness == 0


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"expected key\.sub=value"):
        load_config(ROOT / "configs/tiny.yaml", ["learner.total_steps"])


def test_every_field_is_described() -> None:
    rows = describe_fields()
    assert len(rows) > 50
    missing = [path for path, _, desc in rows if not desc]
    assert missing == []


def _every_field(model: type, prefix: str = "") -> dict[str, str]:
    """Every field reachable from ``model`` (sections, union members, list items) and its description,
    walked from the annotations independently of describe_fields."""
    from typing import get_args

    from tandem.config.base import Section

    def sections(ann: object) -> list[type]:
        if isinstance(ann, type) and issubclass(ann, Section):
            return [ann]
        return [s for a in get_args(ann) for s in sections(a)]

    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"  # the key a config writes (algorithm.distill.as)
        inner = sections(field.annotation)
        ann = field.annotation  # a list, or a list that may be null
        list_of = any(getattr(a, "__origin__", None) is list for a in (ann, *get_args(ann)))
        if inner and not list_of and type(None) not in get_args(field.annotation):
            for s in inner:
                out.update(_every_field(s, path + "."))
            continue
        out[path] = field.description or ""
        for s in inner:
            out.update(_every_field(s, path + ("[]." if list_of else ".")))
    return out


def test_config_doc_has_a_described_row_for_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    fields = _every_field(Config)
    assert "reward.functions[].path" in fields and "prepare[].name" in fields
    assert [path for path, desc in fields.items() if not desc] == []
    assert main(["config-doc"]) == 0
    rows = {line.split("`")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("| `")}
    assert sorted(set(fields) - rows) == []


def test_write_private_is_owner_only_from_creation_and_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("old")
    path.chmod(0o644)
    # A crashed writer's temporary file: its loose mode must not carry over.
    leftover = tmp_path / f".config.yaml.{os.getpid()}.tmp"
    leftover.write_text("x")
    leftover.chmod(0o666)
    write_private(path, "redis: {url: 'redis://:secret@host:6379/0'}")
    assert path.read_text() == "redis: {url: 'redis://:secret@host:6379/0'}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not leftover.exists()


@pytest.mark.parametrize(
    ("engine", "progression", "resolved"),
    [("hf", "auto", "rounds"), ("vllm", "auto", "independent"), ("sglang", "auto", "independent"),
     ("hf", "independent", "independent"), ("vllm", "rounds", "rounds")],
)  # fmt: skip
def test_env_progression_auto_is_resolved_by_the_engine(engine: str, progression: str, resolved: str) -> None:
    raw = {"model": {"actor": "m"}, "data": {"prompts": "p.jsonl"}, "rollout": {"engine": engine},
           "env": {"path": "toy.calculator:CalculatorEnv", "progression": progression}}  # fmt: skip
    assert load_config(None, raw=raw).episode_progression == resolved


def test_a_section_check_is_shown_as_the_field_it_names() -> None:
    with pytest.raises(
        ConfigError, match=r"^invalid config .*\n  learner\.offload_optimizer needs learner\.zero"
    ):
        load_config(ROOT / "configs/tiny.yaml", ["learner.offload_optimizer=true"])


def test_recipe_registry_names_each_section_by_its_recipe() -> None:
    from typing import get_args

    from tandem.config import OFFLINE_RECIPES, RECIPE_CONFIGS, OfflineConfig

    for recipe, section in RECIPE_CONFIGS.items():
        assert get_args(section.model_fields["recipe"].annotation) == (recipe,)
    assert OFFLINE_RECIPES == ("sft", "rm", "dpo")
    assert [r for r, s in RECIPE_CONFIGS.items() if not issubclass(s, OfflineConfig)] == ["ppo"]
    with pytest.raises(ConfigError, match=r"algorithm\.recipe: unknown recipe 'x'; choose from 'ppo', 'sft'"):
        load_config(ROOT / "configs/tiny.yaml", ["algorithm.recipe=x"])


def test_config_package_modules_are_documented_and_functions_short() -> None:
    import ast

    package = ROOT / "tandem" / "config"
    modules = sorted(package.glob("*.py"))
    assert len(modules) > 5
    long = []
    for path in modules:
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.name} has no module docstring"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == []


def test_the_launchers_vision_checks_pass_every_shipped_run_config() -> None:
    """launch.py runs the recipe's vision-actor checks again once prepare steps made the actor; an offline
    recipe's, whose algorithm section has no advantage estimator, must not read one (sft-echo once raised
    AttributeError there)."""
    import yaml

    from tandem.config.checks import vision_checks_for

    for path in sorted(ROOT.glob("configs/*.yaml")):
        if "model" not in yaml.safe_load(path.read_text()):
            continue  # a pipeline of stages, its own schema
        cfg = load_config(path)
        for check in vision_checks_for(cfg.recipe):
            check(cfg)

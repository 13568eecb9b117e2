"""Settings precedence and validation (pure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tide.base.errors import ConfigError
from tide.services.common.config import CommonSettings, load_settings, setting

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class DemoSettings(CommonSettings):
    cooldown_s: float = setting(300.0, "cooldown")
    max_replicas: int = setting(8, "max")
    dry_run: bool = setting(False, "dry run")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cooldown_s < 0:
            raise ConfigError(f"cooldown_s: must be >= 0, got {self.cooldown_s!r}")


def test_defaults() -> None:
    s = load_settings(DemoSettings, [], env={})
    assert (s.cooldown_s, s.max_replicas, s.dry_run) == (300.0, 8, False)


def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cooldown_s: 10\nmax-replicas: 3\ndry_run: true\n")
    env = {"TIDE_CONFIG": str(cfg), "TIDE_COOLDOWN_S": "20"}
    s = load_settings(DemoSettings, ["--cooldown-s", "30"], env=env)
    assert s.cooldown_s == 30.0
    s = load_settings(DemoSettings, [], env=env)
    assert (s.cooldown_s, s.max_replicas, s.dry_run) == (20.0, 3, True)
    s = load_settings(DemoSettings, ["--no-dry-run"], env=env)
    assert s.dry_run is False


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--max-replicas", "2.5"],
            {},
            "max_replicas (from --max-replicas): expected an integer, got '2.5'",
        ),
        (
            [],
            {"TIDE_COOLDOWN_S": "nan"},
            "cooldown_s (from TIDE_COOLDOWN_S): expected a finite number",
        ),
        (["--cooldown-s", "-1"], {}, "cooldown_s: must be >= 0, got -1.0"),
        ([], {"TIDE_DRY_RUN": "maybe"}, "dry_run (from TIDE_DRY_RUN): expected true or false"),
    ],
    ids=["int", "nan", "negative", "bool"],
)
def test_bad_values_are_named(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(DemoSettings, argv, env=env)
    assert message in str(err.value)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cooldown: 10\n")
    with pytest.raises(ConfigError, match=r"cooldown .*unknown setting"):
        load_settings(DemoSettings, ["--config", str(cfg)], env={})


def test_file_must_be_a_mapping(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_settings(DemoSettings, ["--config", str(cfg)], env={})

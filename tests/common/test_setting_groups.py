"""A grouped setting (tide/services/common/config.py, ``setting_group``): a frozen
dataclass held whole, each of its fields a flag, env variable and file key by its own
name, validated by its class."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tide.base.errors import ConfigError
from tide.services.common.config import (
    build_parser,
    load_settings,
    setting,
    setting_fields,
    setting_group,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Window:
    bucket_s: float = 30.0
    buckets: int = field(default=10, metadata={"help": "how many"})

    def __post_init__(self) -> None:
        if self.buckets < 1:
            raise ConfigError(f"window.buckets={self.buckets!r}: must be >= 1")


@dataclass(frozen=True)
class Demo:
    name: str = setting("x", "a plain one")
    window: Window = setting_group(Window(), "the window")  # noqa: RUF009 (a field())


def test_each_field_of_a_group_is_a_setting_of_its_own(tmp_path: Path) -> None:
    names = {st.name: st for st in setting_fields(Demo)}
    assert set(names) == {"name", "bucket_s", "buckets"}
    assert (names["buckets"].help, names["buckets"].group) == ("the window: how many", "window")
    assert "--bucket-s" in build_parser(Demo, prog="t", description="").format_help()
    config = tmp_path / "c.yaml"
    config.write_text("buckets: 4\n")
    s = load_settings(Demo, ["--bucket-s=10"], env={"TIDE_NAME": "y", "TIDE_CONFIG": str(config)})
    assert s == Demo(name="y", window=Window(bucket_s=10.0, buckets=4))
    assert load_settings(Demo, [], env={}).window is Demo().window


def test_a_group_is_validated_by_its_class() -> None:
    with pytest.raises(ConfigError, match=r"window\.buckets=0"):
        load_settings(Demo, [], env={"TIDE_BUCKETS": "0"})
    with pytest.raises(TypeError, match="not a dataclass instance"):
        setting_group(Window, "a class, not an instance")

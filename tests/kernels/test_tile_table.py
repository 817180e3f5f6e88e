"""The tile table: one row per device, chosen once, entries replaced through the kernel settings."""

import pytest
import torch

from mosaicquant import settings
from mosaicquant.errors import UserInputError
from mosaicquant.kernels import _tiles
from mosaicquant.kernels.tile_table import DEVICE_TABLES, TileTable, device_key, table_for

CPU = torch.device("cpu")


def test_a_device_without_a_row_of_its_own_takes_the_default_row():
    assert device_key(CPU) == "default"
    assert table_for(CPU) is DEVICE_TABLES["default"]
    assert table_for("cpu") is table_for(CPU)  # chosen once: the same object every call


def test_settings_replace_single_entries_and_only_inside_their_block():
    base = table_for(CPU)
    with settings.use(tiles={"walk_stages": 3, "swap_row_order": "false"}):
        table = table_for(CPU)
        assert (table.walk_stages, table.swap_row_order) == (3, False)
        assert table.walk_stages_min_m == base.walk_stages_min_m
        with settings.use_tiles(walk_stages_min_m=base.walk_stages_min_m + 1):  # adds to the entries in force
            inner = table_for(CPU)
            assert (inner.walk_stages, inner.walk_stages_min_m) == (3, base.walk_stages_min_m + 1)
            assert _tiles.walk_stages(base.walk_stages_min_m, device=CPU) is None
    assert table_for(CPU) is base
    assert _tiles.walk_stages(base.walk_stages_min_m, device=CPU) == base.walk_stages


def test_bad_entries_are_refused_naming_the_entry_and_what_is_allowed():
    with pytest.raises(UserInputError, match=r"tiles entry 'walk_stages' is not allowed: write name=value"):
        settings.KernelSettings(tiles=("walk_stages",))
    with settings.use(tiles={"walk_stage": 3}), pytest.raises(
            UserInputError, match=r"unknown entry 'walk_stage'; allowed: dense_gated_max_m, .*walk_stages"):
        table_for(CPU)
    with settings.use(tiles={"walk_stages": "deep"}), pytest.raises(UserInputError, match="'deep' is not an integer"):
        table_for(CPU)


def test_settings_with_tiles_round_trip_and_compare_as_one_value():
    a = settings.KernelSettings(tiles={"WALK_STAGES": 4, "decode_stages": 3})
    b = settings.KernelSettings.from_dict({"tiles": "decode_stages=3,walk_stages=4"})
    assert a == b and a.tiles == ("decode_stages=3", "walk_stages=4")
    assert settings.KernelSettings.from_json(a.to_json()) == a
    assert set(TileTable.__dataclass_fields__) >= {"walk_stages", "decode_stages"}

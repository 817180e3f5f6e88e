"""mosaicquant.settings: the kernels' typed settings, validated, in force only inside their block."""

import threading

import pytest

from mosaicquant import settings
from mosaicquant.errors import UserInputError
from mosaicquant.harness.suites.speed import LatencyConfig, ThroughputConfig, kernel_settings


def test_defaults_are_the_kernels_defaults():
    s = settings.current()
    assert s == settings.KernelSettings()
    assert (s.kernel, s.pdl, s.pdl_chain, s.prefetch_mib) == ("auto", True, "on", None)
    assert s.tiles == ()


def test_use_nests_and_restores_even_on_an_exception():
    with settings.use(pdl=False) as outer:
        assert settings.current() is outer and not outer.pdl
        with settings.use(prefetch_mib=8):
            inner = settings.current()
            assert (inner.pdl, inner.prefetch_mib) == (False, 8.0)  # changes apply to the settings in force
        assert settings.current().prefetch_mib is None
        with pytest.raises(RuntimeError), settings.use(pdl_chain="off"):
            raise RuntimeError("inside")
        assert settings.current().pdl_chain == "on"
    assert settings.current() == settings.KernelSettings()


def test_a_block_does_not_reach_another_thread():
    seen = []
    with settings.use(pdl=False):
        worker = threading.Thread(target=lambda: seen.append(settings.current().pdl))
        worker.start()
        worker.join()
    assert seen == [True]


def test_text_values_are_coerced_and_canonical():
    s = settings.KernelSettings.from_dict({"kernel": " Torch ", "pdl": "off", "pdl_chain": "OFF",
                                           "prefetch_mib": "16", "tiles": ["Zip_Block_N=64"]})
    assert (s.kernel, s.pdl, s.pdl_chain, s.prefetch_mib, s.tiles) == ("torch", False, "off", 16.0, ("zip_block_n=64",))
    assert settings.KernelSettings.from_json(s.to_json()) == s


@pytest.mark.parametrize("changes,message", [
    ({"kernel": "cuda"}, "kernel='cuda' is not allowed: choose one of 'auto', 'triton', 'torch'"),
    ({"pdl_chain": "early"}, "pdl_chain='early' is not allowed: choose one of 'off', 'on'"),
    ({"prefetch_mib": float("nan")}, "prefetch_mib=nan is out of range"),
    ({"pdl": "sometimes"}, "pdl='sometimes' is not a boolean"),
    ({"pdl_mode": "on"}, "KernelSettings has no option 'pdl_mode'"),
])
def test_bad_values_name_the_value_and_the_allowed_ones(changes, message):
    with pytest.raises(UserInputError) as err, settings.use(**changes):
        pass
    assert message in str(err.value)
    assert settings.current() == settings.KernelSettings()  # nothing was put in force
    with pytest.raises(UserInputError, match="settings must be a KernelSettings, got dict"), settings.use({"pdl": 0}):
        pass


@pytest.mark.parametrize("config_type", [ThroughputConfig, LatencyConfig])
def test_speed_suites_pass_their_options_as_settings(config_type):
    config = config_type.from_dict({"pdl": "false", "pdl_chain": "Off", "prefetch_mib": "8"})
    assert config.pdl_chain == "off" and config.overrides() == {"pdl": False, "pdl_chain": "off", "prefetch_mib": 8.0}
    with settings.use(kernel="torch"):
        chosen = kernel_settings(config)
    assert (chosen.pdl, chosen.pdl_chain, chosen.prefetch_mib, chosen.kernel) == (False, "off", 8.0, "torch")
    assert config_type().overrides() == {}  # the defaults change no suite label
    with pytest.raises(UserInputError, match="pdl_chain='sideways' is not allowed"):
        config_type(pdl_chain="sideways")

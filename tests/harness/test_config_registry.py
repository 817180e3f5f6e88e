"""Configs, the registry and run-spec parsing: errors name the bad value and what is allowed."""

import json
from dataclasses import dataclass

import pytest

from mosaicquant.baselines.rtn import RTNConfig
from mosaicquant.config import Config, check_range, parse_kv_pairs
from mosaicquant.errors import UserInputError
from mosaicquant.harness.models import model_architecture
from mosaicquant.harness.runner import check_supported
from mosaicquant.harness.spec import RunSpec, load_run_spec, parse_plugin_list, parse_plugin_spec
from mosaicquant.methods.rotation import SUPPORTED_ARCHITECTURES
from mosaicquant.registry import Registry, Supports, get_method, get_suite


def test_config_roundtrip_json_yaml():
    cfg = RTNConfig(wbits=8, abits=8, w_group_size=128, a_clip=0.9)
    assert RTNConfig.from_json(cfg.to_json()) == cfg
    assert RTNConfig.from_yaml(cfg.to_yaml()) == cfg
    assert json.loads(cfg.to_json())["w_group_size"] == 128


def test_config_is_frozen_and_coerces_strings():
    cfg = RTNConfig.from_dict({"wbits": "8", "w_clip_search": "false", "a_clip": "0.9", "w_group_size": "none"})
    assert cfg.wbits == 8 and cfg.w_clip_search is False and cfg.a_clip == 0.9 and cfg.w_group_size is None
    with pytest.raises(Exception):
        cfg.wbits = 4


@pytest.mark.parametrize(
    "options, match",
    [
        ({"wbits": 9}, r"wbits=9 is out of range: allowed integers 2..8 or 16"),
        ({"abits": 1}, r"abits=1 is out of range"),
        ({"wbits": "four"}, r"wbits='four' is not an integer"),
        ({"a_clip": 1.5}, r"a_clip=1.5 is out of range"),
        ({"bogus": 1}, r"no option 'bogus': allowed wbits, abits"),
    ],
)
def test_config_errors(options, match):
    with pytest.raises(UserInputError, match=match):
        RTNConfig.from_dict(options)


def test_unknown_method_did_you_mean():
    with pytest.raises(UserInputError, match=r"Unknown method 'rnt'\. Did you mean: rtn\? Available: .*fp16.*rtn"):
        get_method("rnt")
    with pytest.raises(UserInputError, match=r"Unknown suite 'acuracy'\. Did you mean: accuracy\?"):
        get_suite("acuracy")


def test_registry_rejects_duplicates_and_bad_config():
    reg = Registry("method", "mosaicquant.test-nothing")

    @dataclass(frozen=True)
    class DemoConfig(Config):
        x: int = 1

    reg.register("demo", lambda m, c, ctx: m, DemoConfig)
    with pytest.raises(ValueError, match="duplicate method name 'demo'"):
        reg.register("demo", lambda m, c, ctx: m, DemoConfig)
    with pytest.raises(TypeError, match="Config subclass"):
        reg.register("other", lambda m, c, ctx: m, dict)
    with pytest.raises(ValueError, match="no ':' or ','"):
        reg.register("a:b", lambda m, c, ctx: m, DemoConfig)
    assert reg.get("demo").config is DemoConfig
    assert reg.names() == ["demo"]


def test_registry_keeps_a_methods_speed_form_and_refuses_a_bad_one():
    reg = Registry("method", "mosaicquant.test-nothing")

    @dataclass(frozen=True)
    class DemoConfig(Config):
        x: int = 1

    def form(model, config, ctx):
        return 0, {}

    assert reg.register("demo", lambda m, c, ctx: m, DemoConfig, speed_form=form).speed_form is form
    plain = reg.register("plain", lambda m, c, ctx: m, DemoConfig)
    assert plain.speed_form is None and plain.data_free is False
    assert reg.register("as-is", lambda m, c, ctx: m, DemoConfig, data_free=True).data_free is True
    with pytest.raises(TypeError, match="'bad': speed_form must be a function, got 3"):
        reg.register("bad", lambda m, c, ctx: m, DemoConfig, speed_form=3)
    with pytest.raises(ValueError, match="'both': a data-free method is its own speed form"):
        reg.register("both", lambda m, c, ctx: m, DemoConfig, speed_form=form, data_free=True)
    assert [e.name for e in reg.registered()] == ["as-is", "demo", "plain"]


def test_builtin_speed_forms_are_on_the_methods_entries():
    with_form = {name for name in ("rtn", "smoothquant", "quarot", "spinquant", "atom", "mosaicquant")
                 if get_method(name).speed_form is not None}
    assert with_form == {"rtn", "smoothquant", "quarot", "spinquant", "atom", "mosaicquant"}
    assert get_method("resq").speed_form is None and not get_method("resq").data_free
    assert get_method("torchao").data_free and get_method("torchao").speed_form is None


def test_entry_point_plugin_is_loaded(monkeypatch, tmp_path):
    import importlib.metadata as md
    import sys

    mod = tmp_path / "mq_plugin_demo.py"
    mod.write_text(
        "from dataclasses import dataclass\n"
        "from mosaicquant.config import Config\n"
        "from mosaicquant.registry import register_method\n"
        "@dataclass(frozen=True)\nclass PConfig(Config):\n    k: int = 3\n"
        "@register_method('plugin-demo', config=PConfig)\ndef plugin(model, config, ctx):\n    return model\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = md.EntryPoint(name="plugin-demo", value="mq_plugin_demo", group="mosaicquant.methods")
    real = md.entry_points

    def fake(**kw):
        if kw.get("group") == "mosaicquant.methods":
            return md.EntryPoints([ep])
        return real(**kw)

    monkeypatch.setattr(md, "entry_points", fake)
    assert "plugin-demo" in get_method.__globals__["METHODS"].names()
    entry = get_method("plugin-demo")
    assert entry.config().k == 3 and entry.source.startswith("entry point")
    sys.modules.pop("mq_plugin_demo", None)


def test_parse_kv_pairs():
    assert parse_kv_pairs("a=1:b-c=x") == {"a": "1", "b_c": "x"}
    with pytest.raises(UserInputError, match="key=value"):
        parse_kv_pairs("a")
    with pytest.raises(UserInputError, match="given twice"):
        parse_kv_pairs("a=1:a=2")


def test_method_specs_and_labels():
    specs = parse_plugin_list("fp16,rtn:wbits=8:abits=8,rtn,rtn:abits=8:wbits=8", "method")
    assert [s.label for s in specs] == ["fp16", "rtn:wbits=8:abits=8", "rtn"]
    assert specs[1].config.wbits == 8 and specs[2].config.wbits == 4
    assert parse_plugin_spec({"name": "rtn", "abits": 16}, "method").label == "rtn:abits=16"
    with pytest.raises(UserInputError, match=r"method 'rtn': wbits=9 is out of range"):
        parse_plugin_spec("rtn:wbits=9", "method")


def test_run_spec_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: smollm2-135m\nmethods: [fp16, 'rtn:wbits=8:abits=8']\nsuites: [accuracy]\n"
                 "seeds: [0, 1]\ncalib_samples: 4\nmax_chunks: 2\n")
    spec = load_run_spec(str(f), {"calib_seqlen": 256, "methods": None})
    assert [m.label for m in spec.methods] == ["fp16", "rtn:wbits=8:abits=8"]
    assert spec.seeds == [0, 1] and spec.calib_samples == 4 and spec.calib_seqlen == 256
    assert spec.suites[0].config.max_chunks == 2 and spec.suites[0].label == "accuracy:max_chunks=2"
    f.write_text("model: x\nmethod: [fp16]\n")
    with pytest.raises(UserInputError, match=r"unknown keys \['method'\]"):
        load_run_spec(str(f), {})
    with pytest.raises(UserInputError, match="no suites given"):
        load_run_spec(None, {"model": "m", "methods": "fp16"})
    with pytest.raises(UserInputError, match="calib_samples=0"):
        load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "accuracy", "calib_samples": 0})


def test_check_range_message():
    with pytest.raises(UserInputError, match=r"budget=1.5 is out of range: allowed numbers 0..1"):
        check_range("budget", 1.5, 0, 1)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_check_range_refuses_nan_and_infinities(value):
    # every comparison with NaN is false: without its own check NaN passes any bound
    with pytest.raises(UserInputError, match=r"budget=(nan|inf|-inf) is out of range: allowed numbers 0..1"):
        check_range("budget", value, 0, 1)
    with pytest.raises(UserInputError, match=r"lr=(nan|inf|-inf) is out of range: allowed numbers >= 0"):
        check_range("lr", value, 0, None)
    with pytest.raises(UserInputError, match=r"is out of range: allowed integers >= 1"):
        check_range("calib_samples", value, 1, None, integer=True)


def test_values_with_commas_in_a_list():
    specs = parse_plugin_list("accuracy,analysis:budgets=0.1,0.3:scores=hessian,delta:layers=all,memory", "suite")
    assert [s.name for s in specs] == ["accuracy", "analysis", "memory"]
    assert specs[1].config.budgets == "0.1,0.3" and specs[1].config.scores == "hessian,delta"


def test_float_labels_name_one_value_each():
    # a label that rounds would make two configs one cell (and reuse one's record for the other)
    specs = parse_plugin_list("rtn:a_clip=0.1234567,rtn:a_clip=0.1234568,rtn:a_clip=0.5,rtn:a_clip=0.5000001,"
                              "rtn:a_clip=0.9999999", "method")
    labels = [s.label for s in specs]
    assert labels == ["rtn:a_clip=0.1234567", "rtn:a_clip=0.1234568", "rtn:a_clip=0.5", "rtn:a_clip=0.5000001",
                      "rtn:a_clip=0.9999999"]
    # short values keep their short labels
    assert [s.label for s in parse_plugin_list("mosaicquant:budget=0.250,mosaicquant:budget=1e-5", "method")] == [
        "mosaicquant:budget=0.25", "mosaicquant:budget=1e-05"]


def test_one_value_written_two_ways_is_one_config():
    # block shapes: case, a square written out, the default written out
    specs = parse_plugin_list("mosaicquant:block=16,mosaicquant:block=16x16,mosaicquant:block=64X128,"
                              "mosaicquant:block=64x128,mosaicquant:block=128x128,mosaicquant", "method")
    assert [s.label for s in specs] == ["mosaicquant:block=16", "mosaicquant:block=64x128", "mosaicquant"]
    assert parse_plugin_spec("mosaicquant:block=64X128", "method").config.block_shape == (64, 128)
    # number and index lists of the analysis suite
    specs = parse_plugin_list("analysis:budgets=0.1,0.3,analysis:budgets=0.10,0.30,analysis:budgets=0.05,0.1,0.20,0.3"
                              ":block=64x64", "suite")
    assert [s.label for s in specs] == ["analysis:budgets=0.1,0.3", "analysis"]
    same = [parse_plugin_spec({"name": "analysis", "layers": text}, "suite") for text in ("3,0,0", "0,3", "0;03")]
    assert {s.label for s in same} == {"analysis:layers=0,3"}
    assert parse_plugin_spec({"name": "analysis", "layers": "every:06"}, "suite").label == "analysis"
    with pytest.raises(UserInputError, match=r"layers='x': expected 'all', 'every:K' \(K >= 1\) or a comma list"):
        parse_plugin_spec({"name": "analysis", "layers": "x"}, "suite")
    with pytest.raises(UserInputError, match=r"budgets='0.1,x': expected comma-separated fractions"):
        parse_plugin_spec({"name": "analysis", "budgets": "0.1,x"}, "suite")


def test_a_name_after_an_option_starts_a_new_item():
    # a misspelt name after an option is an unknown name, not part of the option's value
    with pytest.raises(UserInputError, match=r"Unknown method 'fp17'\. Did you mean: fp16\?"):
        parse_plugin_list("rtn:wbits=8,fp17", "method")
    with pytest.raises(UserInputError, match=r"Unknown suite 'memroy'\. Did you mean: memory\?"):
        parse_plugin_list("memory,accuracy:seqlen=64,memroy", "suite")
    # numbers, shapes and the elements of list options still continue the value
    specs = parse_plugin_list("latency:groups=qkv_proj,o_proj:ms=1,16,throughput:batches=4,8", "suite")
    assert [s.label for s in specs] == ["latency:ms=1,16:groups=qkv_proj,o_proj", "throughput:batches=4,8"]
    specs = parse_plugin_list("zeroshot:tasks=piqa,lambada:limit=3", "suite")
    assert [s.name for s in specs] == ["zeroshot"] and specs[0].config.tasks == ("piqa", "lambada")


_BASE_YAML = "model: smollm2-135m\nmethods: [fp16]\nsuites: [accuracy]\n"


@pytest.mark.parametrize(
    "line, message",
    [
        ("seeds: [abc]", r"seed 'abc' is not an integer: allowed integers 0\.\.2147483647"),
        ("seeds:", r"no seeds given: allowed integers 0\.\.2147483647"),
        ("seeds: []", r"no seeds given"),
        ("seeds: 1.7", r"seed 1\.7 is not an integer"),
        ("seeds: [1.7]", r"seed 1\.7 is not an integer"),
        ("seeds: true", r"seed True is not an integer"),
        ("seeds: [0, -1]", r"seed=-1 is out of range: allowed integers 0\.\.2147483647"),
        ("calib_samples: abc", r"calib_samples='abc' is not an integer: allowed integers >= 1"),
        ("calib_samples:", r"calib_samples is empty: allowed integers >= 1"),
        ("calib_samples: true", r"calib_samples=True is not an integer"),
        ("calib_seqlen: 2.9", r"calib_seqlen=2\.9 is not an integer: allowed integers >= 2"),
        ("max_chunks: abc", r"max_chunks='abc' is not an integer: allowed integers >= 1"),
        ("max_chunks: 1.5", r"max_chunks=1\.5 is not an integer"),
        ("out:", r"out is empty: give a results directory"),
        ("corpus:", r"corpus is empty: give a corpus name"),
        ("corpus: 7", r"corpus=7 is not a string"),
        ("device: ''", r"device is empty: give 'cpu', 'cuda' or 'cuda:N'"),
        ("dtype:", r"dtype is empty"),
        ("model: [a, b]", r"model=\['a', 'b'\] is not a string"),
        ("methods: {name: rtn}", r"methods=\{'name': 'rtn'\}: expected a comma-separated string or a list"),
    ],
)
def test_run_spec_keys_are_type_checked(tmp_path, line, message):
    # a wrong type is one line naming the key, the value and what is allowed: never a traceback or a truncation
    key = line.split(":")[0]
    text = "\n".join(x for x in _BASE_YAML.splitlines() if not x.startswith(key + ":")) + "\n" + line + "\n"
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(UserInputError, match=message) as err:
        load_run_spec(str(f), {})
    assert "\n" not in str(err.value)


def test_invalid_yaml_is_one_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: [\n")
    with pytest.raises(UserInputError, match=r"is not valid YAML: .* at line 2, column 1$") as err:
        load_run_spec(str(f), {})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("seeds", ["", ",", " , "])
def test_no_seeds_is_an_error(seeds):
    with pytest.raises(UserInputError, match="no seeds given"):
        load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "accuracy", "seeds": seeds})


def test_repeated_seeds_and_suites_made_equal_by_max_chunks_are_merged():
    spec = load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "accuracy,accuracy:max_chunks=3",
                                "seeds": "1,0,1,0", "max_chunks": 3})
    assert spec.seeds == [1, 0]
    assert [s.label for s in spec.suites] == ["accuracy:max_chunks=3"]
    spec = load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "accuracy:max_chunks=3,accuracy",
                                "seeds": [0, 0]})
    assert spec.seeds == [0] and [s.label for s in spec.suites] == ["accuracy:max_chunks=3", "accuracy"]


@pytest.mark.parametrize("chunks", [0, -2])
def test_max_chunks_is_checked_without_a_suite_that_uses_it(chunks):
    with pytest.raises(UserInputError, match=rf"max_chunks={chunks} is out of range: allowed integers >= 1"):
        load_run_spec(None, {"model": "m", "methods": "fp16", "suites": "memory", "max_chunks": chunks})


def test_supports_names_the_refused_value_and_the_allowed_set():
    only = Supports(devices=("cuda",), dtypes=("bfloat16",), architectures=("LlamaForCausalLM",))
    assert only.refusal("cuda:1", "bfloat16", "LlamaForCausalLM") is None
    assert only.refusal("cuda", "bfloat16", None) is None  # a class not known before loading is checked later
    with pytest.raises(UserInputError, match=r"method 'demo': device 'cpu' is not supported: allowed 'cuda'"):
        only.check("demo", "cpu", "bfloat16", "LlamaForCausalLM")
    with pytest.raises(UserInputError, match=r"dtype 'float16' is not supported: allowed 'bfloat16'"):
        only.check("demo", "cuda", "float16", "LlamaForCausalLM")
    with pytest.raises(UserInputError, match=r"architecture 'GPT2LMHeadModel' is not supported: allowed "
                                             r"'LlamaForCausalLM'"):
        only.check("demo", "cuda", "bfloat16", "GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"'tpu' is not allowed: choose from \('cpu', 'cuda'\)"):
        Supports(devices=("tpu",))
    with pytest.raises(ValueError, match=r"Supports.architectures=\(\)"):
        Supports(architectures=())


def test_registry_keeps_a_methods_supports_and_refuses_a_bad_one():
    reg = Registry("method", "mosaicquant.test-nothing")

    @dataclass(frozen=True)
    class DemoConfig(Config):
        x: int = 1

    cuda = Supports(devices=("cuda",))
    assert reg.register("plain", lambda m, c, ctx: m, DemoConfig).supports_for() == Supports()
    assert reg.register("gpu", lambda m, c, ctx: m, DemoConfig, supports=cuda).supports_for() is cuda
    by_option = reg.register("by-option", lambda m, c, ctx: m, DemoConfig,
                             supports=lambda config: cuda if config.x > 1 else Supports())
    assert by_option.supports_for(DemoConfig(x=2)) is cuda and by_option.supports_for() == Supports()
    with pytest.raises(TypeError, match="'bad': supports must be a Supports or fn"):
        reg.register("bad", lambda m, c, ctx: m, DemoConfig, supports=("cuda",))


def test_transform_methods_take_the_transforms_class_table():
    for name in ("quarot", "spinquant", "smoothquant", "mosaicquant"):
        assert get_method(name).supports_for().architectures == SUPPORTED_ARCHITECTURES, name
    none = parse_plugin_spec("mosaicquant:transform=none", "method")
    assert none.entry.supports_for(none.config).architectures is None
    assert get_method("rtn").supports_for().architectures is None


def test_a_run_is_refused_for_an_architecture_its_method_cannot_transform():
    spec = RunSpec(model="llama-3-8b-shapes", methods=parse_plugin_list("rtn,quarot", "method"),
                   suites=parse_plugin_list("memory", "suite"))
    assert model_architecture(spec.model) == "LlamaForCausalLM"
    check_supported(spec, model_architecture(spec.model))
    check_supported(spec, None)
    with pytest.raises(UserInputError, match=r"method 'quarot': model architecture 'GPT2LMHeadModel' is not "
                                             r"supported: allowed 'LlamaForCausalLM', 'Qwen2ForCausalLM'"):
        check_supported(spec, "GPT2LMHeadModel")

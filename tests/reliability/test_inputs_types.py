"""A value of the wrong type for a config option: one message naming the value, the option, the type and the
range the option allows, from a config's ``from_dict`` and from a ``name:key=value`` method or suite item."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from mosaicquant.config import Config, WrongType, check_range
from mosaicquant.errors import UserInputError
from mosaicquant.harness.spec import parse_plugin_spec


@dataclass(frozen=True)
class DemoConfig(Config):
    bits: int = 4
    group: int | None = None
    ratio: float = 0.5
    sizes: tuple[int, ...] = (1, 2)
    exact: bool = True
    name: str = "a"
    mode: Literal["fast", "exact"] = "fast"

    def validate(self):
        check_range("bits", self.bits, 2, 8, integer=True, extra=(16,))
        if self.group is not None:
            check_range("group", self.group, 1, None, integer=True)
        check_range("ratio", self.ratio, 0.0, 1.0)
        for size in self.sizes:
            check_range("sizes", size, 1, 64, integer=True)


@pytest.mark.parametrize("data, message", [
    ({"bits": "four"}, r"^bits='four' is not an integer: allowed integers 2\.\.8 or 16$"),
    ({"bits": 4.5}, r"^bits=4\.5 is not an integer: allowed integers 2\.\.8 or 16$"),
    ({"bits": True}, r"^bits=True is not an integer: allowed integers 2\.\.8 or 16$"),
    ({"bits": [4]}, r"^bits=\[4\] is not an integer: allowed integers 2\.\.8 or 16$"),
    ({"group": "x"}, r"^group='x' is not an integer: allowed integers >= 1 or none$"),
    ({"ratio": "half"}, r"^ratio='half' is not a number: allowed numbers 0\.0\.\.1\.0$"),
    ({"ratio": False}, r"^ratio=False is not a number: allowed numbers 0\.0\.\.1\.0$"),
    ({"sizes": "1,x"}, r"^sizes='x' is not an integer: allowed a list of integers 1\.\.64$"),
    ({"exact": "maybe"}, r"^exact='maybe' is not a boolean: allowed true or false$"),
    ({"exact": 3}, r"^exact=3 is not a boolean: allowed true or false$"),
    ({"name": ["a", "b"]}, r"^name=\['a', 'b'\] is not a string: allowed a string$"),
    ({"mode": "quick"}, r"^mode='quick' is not allowed: choose one of 'fast', 'exact'$"),
    # the wrong type is named even where another option is also out of range
    ({"bits": 99, "ratio": "half"}, r"^ratio='half' is not a number: allowed numbers 0\.0\.\.1\.0$"),
], ids=["int-text", "int-float", "int-bool", "int-list", "optional-int", "float-text", "float-bool", "list-item",
        "bool-text", "bool-int", "str-list", "literal", "with-another-bad"])
def test_wrong_type_names_value_option_type_and_range(data, message):
    with pytest.raises(UserInputError, match=message) as err:
        DemoConfig.from_dict(data)
    assert "\n" not in str(err.value)


def test_wrong_type_error_carries_the_option_and_value():
    with pytest.raises(WrongType) as err:
        DemoConfig.from_dict({"ratio": "half"})
    assert (err.value.name, err.value.raw, err.value.kind) == ("ratio", "half", "a number")


@pytest.mark.parametrize("data", [[("bits", 4)], "bits=4", 4])
def test_options_that_are_not_a_mapping_are_named(data):
    with pytest.raises(UserInputError, match=r"DemoConfig options must be a mapping of option to value, got "):
        DemoConfig.from_dict(data)


@pytest.mark.parametrize("item, kind, message", [
    ("rtn:wbits=x", "method", r"^method 'rtn': wbits='x' is not an integer: allowed integers 2\.\.8 or 16$"),
    ("rtn:w_group_size=big", "method",
     r"^method 'rtn': w_group_size='big' is not an integer: allowed integers >= 1 or none$"),
    ("rtn:a_clip=most", "method", r"^method 'rtn': a_clip='most' is not a number: allowed numbers 0\.01\.\.1\.0$"),
    ("rtn:w_symmetric=maybe", "method", r"^method 'rtn': w_symmetric='maybe' is not a boolean: allowed true or false$"),
    ({"name": "rtn", "abits": [4]}, "method",
     r"^method 'rtn': abits=\[4\] is not an integer: allowed integers 2\.\.8 or 16$"),
    ("throughput:batches=4,x", "suite", r"^suite 'throughput': batches='x' is not an integer: allowed a list of "
                                        r"integers >= 1$"),
    ("accuracy:seqlen=long", "suite", r"^suite 'accuracy': seqlen='long' is not an integer: allowed integers >= 2$"),
])
def test_method_and_suite_options_of_the_wrong_type(item, kind, message):
    with pytest.raises(UserInputError, match=message):
        parse_plugin_spec(item, kind)

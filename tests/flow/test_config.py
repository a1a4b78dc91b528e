"""qbackend.QuantizeConfig: quantize_x86's options as one object of plain data, accepted where
the keyword arguments are, read back from JSON and from an archive's recorded recipe."""
import json

import pytest
import torch

import qbackend

from tests.flow.test_misuse import _model_and_input


def test_a_config_quantizes_as_its_keywords_and_comes_back_from_the_archive(tmp_path):
    model, x = _model_and_input()
    config = qbackend.QuantizeConfig(reduce_range="weights", keep_float=["second"], activation_ranges="min_max",
                                     bias_correction=False)
    assert qbackend.QuantizeConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    from_config = qbackend.quantize_x86(model, (x,), [(x,)], config=config)
    from_keywords = qbackend.quantize_x86(model, (x,), [(x,)], reduce_range="weights", keep_float=["second"],
                                          activation_ranges="min_max", bias_correction=False)
    assert from_config.code == from_keywords.code
    with torch.no_grad():
        assert torch.equal(from_config(x), from_keywords(x))
    qbackend.save(from_config, tmp_path / "model.pt2")
    recorded = qbackend.inspect(tmp_path / "model.pt2")["recipe"]["options"]
    assert qbackend.QuantizeConfig.from_dict(recorded) == config  # (the recipe repeats: same options)


def test_a_keyword_that_disagrees_with_the_config_is_an_error():
    model, x = _model_and_input()
    with pytest.raises(ValueError, match="pass every_linear in config or as keyword arguments, not both"):
        qbackend.quantize_x86(model, (x,), [(x,)], every_linear=False, config=qbackend.QuantizeConfig(every_linear=True))
    with pytest.raises(TypeError, match="config must be a qbackend.QuantizeConfig"):
        qbackend.quantize_x86(model, (x,), [(x,)], config={"every_linear": False})


@pytest.mark.parametrize("data, message", [({"reduce_rnage": True}, r"unknown option\(s\) \['reduce_rnage'\]"),
                                           ({"smooth": {"alpha": len}}, "is not plain data"),
                                           ({"keep_float": [torch.nn.Linear]}, "is not plain data")])
def test_bad_config_data_is_named(data, message):
    with pytest.raises(ValueError, match=message):
        qbackend.QuantizeConfig.from_dict(data)


def test_recorded_code_options_are_skipped_not_configured():
    recorded = {"validate": "my.metric", "transform_fn": "f", "progress": None, "dynamic_shapes": None, "every_linear": False}
    assert qbackend.QuantizeConfig.from_dict(recorded) == qbackend.QuantizeConfig(every_linear=False)

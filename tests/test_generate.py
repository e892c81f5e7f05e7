"""`graphtrain generate`: greedy is the argmax of the model's logits, top-p samples from the
renormalised nucleus, the CLI continues a prompt from a run's newest checkpoint."""

import pytest
import torch

from graphtrain.checkpoint.trained import load_trained
from graphtrain.cli import main
from graphtrain.generate import generate_ids, sample_next


def test_greedy_is_the_argmax():
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
    out = sample_next(logits, temperature=0.0, top_p=1.0, generator=None)
    assert torch.equal(out, logits.argmax(-1))


def test_top_p_samples_the_renormalised_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(20000, 4)
    g = torch.Generator().manual_seed(1)
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it -> {0, 1} with 5/8 and 3/8.
    draws = sample_next(logits, temperature=1.0, top_p=0.7, generator=g)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[2] == 0 and freq[3] == 0
    # 20000 draws: the standard error of a frequency near 0.6 is ~0.0035; 0.02 is > 5 of them.
    assert freq[0].item() == pytest.approx(5 / 8, abs=0.02)
    # top_p 1 and temperature 2: all four, from softmax(log p / 2) ~ sqrt(p).
    draws = sample_next(logits, temperature=2.0, top_p=1.0, generator=g)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    expected = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(freq, expected.double(), atol=0.02)
    with pytest.raises(ValueError, match="top_p in"):
        sample_next(logits, temperature=1.0, top_p=0.0, generator=g)


def test_generate_from_a_run(debug_run, capsys):
    trained = load_trained(debug_run, "cpu")
    prompt = trained.tokenizer.encode("alpha beta")
    new = generate_ids(
        trained.model, prompt, max_new_tokens=5, max_seq_len=trained.cfg.model.max_seq_len
    )
    # Greedy: each token is the argmax of the model's logits after the tokens before it.
    ids = list(prompt)
    for token in new:
        with torch.no_grad():
            logits = trained.model(torch.tensor([ids]))[0, -1]
        assert token == int(logits.argmax())
        ids.append(token)
    text = trained.tokenizer.decode(new)
    assert (
        main(
            [
                "generate",
                str(debug_run),
                "--prompt",
                "alpha beta",
                "--temperature=0",
                "--max-new-tokens=5",
                "--device=cpu",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "alpha beta" + text + "\n"
    # Sampling is reproducible with its seed.
    args = ["generate", str(debug_run), "--prompt", "gamma", "--seed=3", "--max-new-tokens=8"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first

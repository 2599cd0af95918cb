"""A seeded evaluation leaves every RNG stream of training as it was (issue 29, item 5).

``torch.manual_seed`` reseeds every CUDA device; ``fork_rng(devices=[])`` restored the CPU's stream only, so
each seeded evaluation reset training's CUDA sampling stream.  This machine has no GPU: the CUDA generators
are simulated (a per-device state that ``torch.cuda.manual_seed_all`` reseeds and ``get/set_rng_state`` read
and write), with ``torch.accelerator`` reporting CUDA — the functions torch's own ``manual_seed`` and
``fork_rng`` call.  The same checks fail with the former ``fork_rng(devices=[])``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from marlhf.sampler import GenerationConfig, sample
from marlhf.utils import rng


class FakeCuda:
    """Host-side stand-ins for N CUDA generators: a state per device, a draw advances it."""

    def __init__(self, n: int):
        self.states = {i: torch.tensor([1000 + i, 0]) for i in range(n)}
        self.n = n

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
        mp.setattr(torch.cuda, "device_count", lambda: self.n)
        mp.setattr(torch.cuda, "manual_seed_all", self.manual_seed_all)
        mp.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[int(device)].clone())
        mp.setattr(torch.cuda, "set_rng_state", self.set_rng_state)

    def manual_seed_all(self, seed: int) -> None:
        for i in self.states:
            self.states[i] = torch.tensor([seed, 0])

    def set_rng_state(self, state, device="cuda") -> None:
        self.states[int(device)] = state.clone()

    def draw(self) -> list[list[int]]:
        """What a CUDA sampling step would leave behind: every device's generator advanced."""
        for i in self.states:
            self.states[i][1] += 1
        return [s.tolist() for s in self.states.values()]


@pytest.fixture()
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def training_stream(fake: FakeCuda, evaluate) -> tuple[list, list]:
    """Three training draws (CPU and devices) with ``evaluate()`` between the first and second."""
    cpu, dev = [], []
    torch.manual_seed(11)  # the run's seed: CPU and every device
    for k in range(3):
        cpu.append(torch.rand(4).tolist())
        dev.append(fake.draw())
        if k == 0:
            evaluate()
    return cpu, dev


def test_a_seeded_sample_leaves_the_cpu_and_every_devices_stream_as_it_was(model):
    fake = FakeCuda(3)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    cfg = GenerationConfig(max_new_tokens=4, stop_ids=(2,), pad_id=0, temperature=1.0, top_k=0, top_p=1.0,
                           seed=123)
    answers = []

    def evaluate():  # seeds CPU and devices (torch.manual_seed inside sample), then draws from both
        answers.append(sample(model, ids, mask, cfg).seq)

    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng(devices=[]):
        fake.install(mp)
        plain = training_stream(fake, lambda: None)
        with_eval = training_stream(fake, evaluate)
        training_stream(fake, evaluate)
    assert with_eval == plain  # CPU draws and every device's generator continue as without the evaluation
    assert torch.equal(answers[0], answers[1])  # the evaluation itself is seeded
    assert plain[1][1] == [[11, 2], [11, 2], [11, 2]]  # the devices' stream: the run's seed, two draws on


def test_the_former_cpu_only_fork_let_the_evaluation_reseed_the_devices():
    """The check above can fail: with fork_rng(devices=[]) the devices' stream restarts from the eval seed."""
    fake = FakeCuda(2)

    def evaluate():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)

    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng(devices=[]):
        fake.install(mp)
        plain = training_stream(fake, lambda: None)
        old = training_stream(fake, evaluate)
    assert old[0] == plain[0]  # the CPU stream was restored
    assert old[1] != plain[1] and old[1][1] == [[123, 1], [123, 1]]  # the devices' was not


def test_isolated_rng_forks_every_visible_device_of_the_accelerator(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def spy(devices=None, enabled=True, device_type=None, **kw):
        calls.append((list(devices), device_type))
        yield

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.random, "fork_rng", spy)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(("seed", seed)))
    assert rng.rng_devices() == ("cuda", [0, 1, 2, 3])
    with rng.isolated_rng(7):
        calls.append("body")
    assert calls == [([0, 1, 2, 3], "cuda"), ("seed", 7), "body"]


def test_on_a_cpu_only_machine_only_the_cpu_stream_is_forked(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert rng.rng_devices() == (None, [])
    torch.manual_seed(5)
    first = torch.rand(3)
    torch.manual_seed(5)
    with rng.isolated_rng(99):
        torch.rand(10)
    assert torch.equal(torch.rand(3), first)

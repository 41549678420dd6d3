"""The main job's GPU section: a full-size SDXL UNet (real config, random weights built on the GPU) stepped by
plain diffusers, diffusers+PEFT and fd-lora on the same weights: one adapter, a 4-adapter blend, a different adapter
per prompt and a slider moved before every step. Outputs are checked against PEFT first; steps are timed in
interleaved rounds (benchmarks/bench_fullsize.py is the full benchmark). About two minutes on an H100."""

from __future__ import annotations

import copy
import statistics

import torch

from ...testing import step_ms


def _shared_copy(model):
    """A second module tree over the same weight tensors (no second copy of the weights)."""
    return copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]})


def run(rounds: int = 6, device: str = "cuda", tiny: bool = False) -> bool:
    """tiny: the same section on toy widths (a CPU smoke test of every step of it)."""
    from peft import LoraConfig

    import fdlora
    from fdlora.fixtures import fullsize
    from fdlora.integrations.transformers import adapter_from_peft

    base = fullsize.sdxl_unet(device, torch.float16 if device == "cuda" else torch.float32, tiny=tiny)
    inputs = fullsize.sdxl_inputs(base, batch=2, tokens=fullsize.SDXL_TOKENS_TINY if tiny else fullsize.SDXL_TOKENS)
    peft = _shared_copy(base)
    names = [f"a{i}" for i in range(4)]
    for i, n in enumerate(names):
        torch.manual_seed(i)
        peft.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=fullsize.SDXL_TARGETS,
                                    init_lora_weights=False), n)
        with torch.no_grad():
            for m in peft.modules():
                if hasattr(m, "lora_B") and n in m.lora_B:
                    m.lora_B[n].weight.mul_(0.1)  # random LoRAs at the strength of trained ones
    fd = _shared_copy(base)
    h = fdlora.inject(fd, fullsize.SDXL_TARGETS, max_slots=4, max_rank=16)
    for n in names:
        h.add_adapter(adapter_from_peft(peft, n), n, activate=False)
    where = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"\n[full size, {where}] SDXL UNet ({'toy widths' if tiny else '2.6 B params, fp16, batch 2, 1024x1024'}), "
          f"{len(h.layers)} LoRA layers r16")

    def out(m, **kw):
        y = m(**inputs, **kw)
        return (y[0] if isinstance(y, tuple) else y.sample).float()

    ok = True
    with torch.inference_mode():
        for active, weights in ((["a0"], [1.0]), (names, [0.4, 0.3, 0.2, 0.1])):
            peft.set_adapters(active, weights)
            fdlora.set_adapters(fd, active, weights)
            want = out(peft)
            err = float((out(fd) - want).abs().max() / want.abs().max())
            ok &= err < 3e-2
            print(f"  {'+'.join(active)} vs diffusers+PEFT: max rel err {err:.1e} {'OK' if err < 3e-2 else 'MISMATCH'}")
        w = iter(range(10**9))

        def slider():
            fdlora.set_adapters(fd, ["a0"], [0.2 + next(w) % 9 / 10])
            fd(**inputs)

        def per_prompt():
            with fdlora.per_sample(fd, ["a0", "a1"]):
                fd(**inputs)

        peft.set_adapters(["a0"], [1.0])
        cases = [("diffusers+PEFT, 1 adapter", lambda: peft(**inputs), None),
                 ("fd-lora, 1 adapter", lambda: fd(**inputs), (["a0"], [1.0])),
                 ("fd-lora, 4-adapter blend", lambda: fd(**inputs), (names, [0.4, 0.3, 0.2, 0.1])),
                 ("fd-lora, adapter per prompt", per_prompt, (["a0"], [1.0])),
                 ("fd-lora, slider moved every step", slider, None)]
        print(f"\n  {'step (interleaved with the base step)':44s} {'ms':>8s} {'x base':>7s}")
        for what, fn, blend in cases:
            if blend is not None:
                fdlora.set_adapters(fd, *blend)
            fn(), base(**inputs)
            pairs = [(step_ms(lambda: base(**inputs), device), step_ms(fn, device)) for _ in range(rounds)]
            ms = statistics.median(p[1] for p in pairs)
            x = statistics.median(p[1] / p[0] for p in pairs)
            print(f"  {what:44s} {ms:8.1f} {x:7.2f}")
    print(f"  merged-weight copies held: {fdlora.merge_cache_bytes() / 2**30:.1f} GiB "
          f"(fdlora.set_merge_cache to change; base step {statistics.median(p[0] for p in pairs):.1f} ms)")
    return ok

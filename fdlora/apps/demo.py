"""`fdlora demo`: a Gradio app with a checkbox and a live weight slider per adapter, a prompt box,
a per-prompt gallery (one batch, a different adapter per prompt) and a status line with the active
weights, the step time and the `set_adapters` latency.

The embedded default is a tiny SD1.5 pipeline built from configs (CPU, nothing downloaded) with two
LoRAs published to a temporary local Hub cache and loaded by repo id. Each request generates inside
`fdlora.adapters(pipe, its own spec)`: the pipe's lock serialises calls, so users never see each
other's adapters, while the sliders set the pipe's default mix live.

Remote callers pick adapters, they never name files: "Add adapter" (`/add_adapter`) loads only what
the operator allowed, the bundled adapters plus each `--allow PATH_OR_REPO` given at start, by that
exact string or its short name. Anything else (another path, `..`, an absolute path, a directory)
gets one refusal that says nothing about the server's filesystem; nothing is opened for it. The
server listens on 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import tempfile
import threading
import time
from typing import Any

import torch

from ..errors import FdLoraError

log = logging.getLogger(__name__)
MAX_ADAPTERS = 8  # slider slots: Gradio components are fixed once the page is built
TINY_SIZE = 64
# the embedded default's LoRAs, each named by its repo's short name: the name a slider shows is the one "Add adapter"
# offers (short_name)
REPOS = {"pixel": "fdlora-demo/pixel", "watercolor": "fdlora-demo/watercolor"}


def _gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio as gr
    except ModuleNotFoundError as e:
        raise FdLoraError("the demo needs Gradio: pip install 'fd-lora[demo]'") from e
    return gr


def tiny_pipe(steps: int = 4):
    """The embedded default: tiny SD1.5 + two random LoRAs, loaded by repo id from a local Hub cache."""
    import fdlora  # noqa: F401  (attaches pipe.load_fd_lora)
    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.fixtures.localcache import populate

    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    cache = tempfile.mkdtemp(prefix="fdlora-demo-hub-")
    for i, repo in enumerate(REPOS.values()):
        populate(cache, repo, tiny.random_lora_files(pipe, seed=i + 1))
    hub = dict(cache_dir=cache, local_files_only=True)
    for name, repo in REPOS.items():
        pipe.load_fd_lora(repo, adapter_name=name, max_slots=MAX_ADAPTERS, **hub)
    pipe.set_adapters(list(REPOS), [1.0] * len(REPOS))
    pipe._fdlora_demo_size = TINY_SIZE
    pipe._fdlora_demo_bundled = {repo: hub for repo in REPOS.values()}  # what /add_adapter may load again
    log.info("demo: tiny SD1.5 with adapters %s from local Hub cache %s", list(REPOS), cache)
    return pipe


def short_name(source: str) -> str:
    """A slider name for a source: the last path / repo component without its weight-file suffix."""
    base = re.sub(r"\.(safetensors|bin|pt)$", "", source.rstrip("/").split("/")[-1])
    return re.sub(r"\W+", "_", base) or "adapter"


def allowlist(bundled: dict[str, dict], allow: list[str] | tuple[str, ...] = ()) -> dict[str, tuple[str, dict]]:
    """What a remote caller may type -> (source, load kwargs): each allowed source by its exact string and by
    its short name (the first source to claim a short name keeps it)."""
    entries = [(src, dict(kw)) for src, kw in bundled.items()] + [(src, {}) for src in allow]
    out: dict[str, tuple[str, dict]] = {}
    for src, kw in entries:
        out.setdefault(src, (src, kw))
        out.setdefault(short_name(src), (src, kw))
    return out


class Demo:
    """The handlers, independent of Gradio: adapter names in slider order, and the calls on the pipe.

    `allow`: the adapters (Hub ids, files, folders) that `add` may load besides the bundled ones."""

    def __init__(self, pipe: Any, steps: int = 4, allow: list[str] | tuple[str, ...] = ()):
        import fdlora

        self.fd, self.pipe, self.steps = fdlora, pipe, steps
        handles = pipe.fd_lora_handles() if hasattr(pipe, "fd_lora_handles") else {}
        self.names = list(dict.fromkeys(n for h in handles.values() for n in h.list_adapters()))
        self.size = getattr(pipe, "_fdlora_demo_size", None)
        self.allowed = allowlist(getattr(pipe, "_fdlora_demo_bundled", {}), allow)
        self._add = threading.Lock()

    def offered(self) -> list[str]:
        """The short names a caller may add (shown in the UI and in every refusal)."""
        return sorted({short_name(src) for src, _ in self.allowed.values()})

    def spec(self, active: list[str] | None, weights: tuple[float, ...]) -> dict[str, float]:
        w = dict(zip(self.names, weights))
        return {n: float(w.get(n, 1.0)) for n in self.names if n in (active or [])}

    @staticmethod
    def describe(spec: dict[str, float]) -> str:
        return ", ".join(f"{n}={w:.2f}" for n, w in spec.items()) or "no adapters (base model)"

    def set_live(self, active, *weights) -> str:
        """A checkbox or slider moved: set the pipe's default mix now and report the latency."""
        spec = self.spec(active, weights)
        t = time.perf_counter()
        if self.names:
            self.pipe.set_adapters(list(spec), list(spec.values()))
        return f"active: {self.describe(spec)} | set_adapters {(time.perf_counter() - t) * 1e3:.3f} ms"

    def _call(self, prompt, **kw):
        stamps: list[float] = []

        def on_step(pipe, i, t, kwargs):
            stamps.append(time.perf_counter())
            return kwargs

        kw.update(prompt=prompt, num_inference_steps=self.steps, output_type="pil",
                  generator=torch.Generator("cpu").manual_seed(0), callback_on_step_end=on_step)
        if self.size:
            kw.update(height=self.size, width=self.size)
        t = time.perf_counter()
        with torch.inference_mode():
            images = self.pipe(**kw).images
        step_ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else stamps[-1] - t
        return [self._show(im) for im in images], step_ms * 1e3

    def _show(self, im):
        from PIL import Image

        return im.resize((256, 256), Image.NEAREST) if im.width < 256 else im

    def generate(self, prompt: str, active, *weights):
        """One image with this request's own adapters (no bleed between concurrent users)."""
        spec = self.spec(active, weights)
        with self.fd.runtime.scope.pipe_lock(self.pipe):  # time set_adapters alone, not the wait for the lock
            t = time.perf_counter()
            with self.fd.adapters(self.pipe, spec) if self.names else contextlib.nullcontext():
                set_ms = (time.perf_counter() - t) * 1e3
                (image,), step_ms = self._call(prompt or "")
        return image, f"active: {self.describe(spec)} | step {step_ms:.1f} ms | set_adapters {set_ms:.3f} ms"

    def gallery(self, prompts: str, active, *weights):
        """One batch, one adapter per prompt: the active adapters are assigned round-robin."""
        lines = [p.strip() for p in (prompts or "").splitlines() if p.strip()] or ["a cat"]
        spec = self.spec(active, weights)
        names = list(spec)
        per = [{names[i % len(names)]: spec[names[i % len(names)]]} if names else None for i in range(len(lines))]
        images, step_ms = self._call(lines, fd_lora_adapters=per)
        captions = [f"{p} [{self.describe(s or {})}]" for p, s in zip(lines, per)]
        status = f"gallery: {len(lines)} prompts in one batch | step {step_ms:.1f} ms"
        return list(zip(images, captions)), status

    def refusal(self) -> FdLoraError:
        """The one answer to every request outside the allowlist: it names no path and echoes nothing."""
        offered = ", ".join(self.offered()) or "none"
        return FdLoraError(f"not an adapter this demo offers; choose one of: {offered} "
                           "(the operator adds more with --allow)")

    def add(self, choice: str) -> str:
        """Load one of the allowed adapters (by its exact source string or short name); returns its name."""
        picked = self.allowed.get((choice or "").strip()) if isinstance(choice, str) else None
        if picked is None:  # decided from the string alone: nothing on disk is looked at
            raise self.refusal()
        source, kwargs = picked
        with self._add:
            if len(self.names) >= MAX_ADAPTERS:
                raise FdLoraError(f"the demo shows at most {MAX_ADAPTERS} adapters; delete one first")
            name = short_name(source)
            while name in self.names:
                name += "_"
            first = {} if self.names else {"max_slots": MAX_ADAPTERS}
            self.pipe.load_fd_lora(source, adapter_name=name, **first, **kwargs)
            self.names.append(name)
        log.info("demo: loaded %s as %r", source, name)
        return name


def build(pipe: Any = None, steps: int = 4, allow: list[str] | tuple[str, ...] = ()):
    """The Gradio Blocks app; `pipe` defaults to the embedded tiny SD1.5 with two adapters; `allow`: the
    extra adapters (Hub ids, files, folders) the "Add adapter" box may load."""
    gr = _gradio()
    demo = Demo(pipe if pipe is not None else tiny_pipe(), steps, allow)

    def slider_updates():
        return [gr.update(visible=i < len(demo.names), label=f"{demo.names[i]} weight" if i < len(demo.names)
                          else f"slot {i}") for i in range(MAX_ADAPTERS)]

    with gr.Blocks(title="fd-lora demo") as app:
        gr.Markdown("## fd-lora: dynamic LoRA, live weights")
        with gr.Row():
            with gr.Column():
                active = gr.CheckboxGroup(demo.names, value=list(demo.names), label="Adapters", elem_id="adapters")
                sliders = [gr.Slider(0.0, 2.0, value=1.0, step=0.05, visible=i < len(demo.names),
                                     label=f"{demo.names[i]} weight" if i < len(demo.names) else f"slot {i}",
                                     elem_id=f"w{i}") for i in range(MAX_ADAPTERS)]
                with gr.Row():
                    source = gr.Textbox(label=f"Add adapter (one of: {', '.join(demo.offered()) or 'none'})",
                                        elem_id="source", scale=3)
                    add = gr.Button("Add", elem_id="add", scale=1)
                prompt = gr.Textbox("a cat", label="Prompt", elem_id="prompt")
                go = gr.Button("Generate", variant="primary", elem_id="go")
                prompts = gr.Textbox("a cat\na dog\na cow", lines=3, label="Gallery prompts (one per line)",
                                     elem_id="prompts")
                go_gallery = gr.Button("Gallery: one batch, one adapter per prompt", elem_id="go-gallery")
            with gr.Column():
                image = gr.Image(label="Image", type="pil", format="png", elem_id="image", height=256, width=256)
                status = gr.Textbox(label="Status", elem_id="status", interactive=False)
                gallery = gr.Gallery(label="Per-prompt gallery", elem_id="gallery", columns=3, height=300,
                                     format="png")
        inputs = [active, *sliders]
        for c in inputs:
            c.change(demo.set_live, inputs, status, api_name=False)
        go.click(demo.generate, [prompt, *inputs], [image, status], api_name="generate")
        go_gallery.click(demo.gallery, [prompts, *inputs], [gallery, status], api_name="gallery")

        def on_add(src, chosen):
            try:
                name = demo.add(src)
            except Exception as e:  # shown in the UI, not a stack trace
                raise gr.Error(str(e)) from e
            return [gr.update(choices=demo.names, value=[*(chosen or []), name]), *slider_updates(),
                    f"loaded {src.strip()} as {name!r}"]

        add.click(on_add, [source, active], [active, *sliders, status], api_name="add_adapter")
    app.fd_demo = demo
    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=None, help="port (default: the first free one from 7860)")
    p.add_argument("--model", default=None,
                   help="a diffusers pipeline (Hub id or folder); default: the embedded tiny SD1.5 (CPU, no download)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    p.add_argument("--allow", action="append", default=[], metavar="PATH_OR_REPO",
                   help="an adapter (Hub id, file or folder) that visitors may add from the page; repeatable. "
                        "Nothing else can be loaded remotely")


def run(args: argparse.Namespace) -> int:
    _gradio()  # fail fast with the install hint
    pipe = None
    if args.model:
        from diffusers import DiffusionPipeline

        import fdlora  # noqa: F401

        cuda = torch.cuda.is_available()
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=torch.float16 if cuda else torch.float32)
        pipe = pipe.to("cuda" if cuda else "cpu")
        pipe.set_progress_bar_config(disable=True)
    build(pipe, args.steps, args.allow).launch(server_name=args.host, server_port=args.port)
    return 0

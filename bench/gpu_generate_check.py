"""GPU smoke check of `attnqat generate`'s --compile and --offload paths through the Python API (no mp4,
so it runs where imageio-ffmpeg is missing): tiny model, bf16, four mode/compile/offload combinations."""
import time, torch, sys
sys.path.insert(0, ".")
from attnqat.pipelines import load_pipeline, patch_attention, AttentionTimer
from attnqat.pipelines.generate import generate_video
dev = torch.device("cuda")
for mode, compile_, offload in [("attn_qat", False, False), ("attn_qat", True, False), ("sage3", False, True), ("nvfp4", True, True)]:
    pipe = load_pipeline("tiny", dtype=torch.bfloat16, device=None if offload else dev)
    timer = AttentionTimer(enabled=not compile_)
    patch_attention(pipe.transformer, mode, timer=timer)
    if offload:
        pipe.enable_model_cpu_offload(device=dev)
    if compile_:
        pipe.transformer.compile_repeated_blocks(fullgraph=True)  # as attnqat generate --compile
    pipe.set_progress_bar_config(disable=True)
    t = time.time()
    r = generate_video(pipe, "fox", negative_prompt="", height=64, width=64, frames=9, steps=4, guidance=5.0, seed=0, timer=timer, device=dev)
    print(f"{mode} compile={compile_} offload={offload}: frames {r.frames.shape} finite {bool((r.frames >= 0).all())} in {time.time()-t:.1f}s", flush=True)

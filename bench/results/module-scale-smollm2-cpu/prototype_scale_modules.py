"""Write a copy of the shipped adapter with its LoRA deltas scaled per module (lora_B x s),
manifest lora_scale 1.0. Usage: python scale_modules.py OUT ATTN_SCALE MLP_SCALE [LAYER_SPLIT LOW_MULT]"""
import json, shutil, sys, re
from pathlib import Path
from safetensors.torch import load_file, save_file
src = Path("pasta_engine/adapters/smollm2-135m-pasta"); out = Path(sys.argv[1])
attn, mlp = float(sys.argv[2]), float(sys.argv[3])
split = int(sys.argv[4]) if len(sys.argv) > 4 else None; low = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
shutil.copytree(src, out, dirs_exist_ok=True)
d = load_file(src / "adapter_model.safetensors")
for k in d:
    if "lora_B" not in k: continue
    s = attn if "self_attn" in k else mlp
    layer = int(re.search(r"layers\.(\d+)\.", k).group(1))
    if split is not None and layer < split: s *= low
    d[k] = (d[k].float() * s).to(d[k].dtype)
save_file(d, out / "adapter_model.safetensors", metadata={"format": "pt"})
m = json.loads((src / "manifest.json").read_text()); m["lora_scale"] = 1.0
(out / "manifest.json").write_text(json.dumps(m, indent=1))
print("wrote", out, attn, mlp, split, low)

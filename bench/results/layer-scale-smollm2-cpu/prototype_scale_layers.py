"""Write a copy of the shipped adapter whose LoRA deltas are scaled per layer: layers below SPLIT
by LOW, layers from SPLIT up by HIGH (lora_B x s; the added tag tokens' rows as trained), manifest
lora_scale 1.0. A prototype for issue 30, not engine code.

Usage: python prototype_scale_layers.py OUT SPLIT LOW HIGH
"""
import json
import re
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

src = Path("pasta_engine/adapters/smollm2-135m-pasta")
out, split, low, high = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
shutil.copytree(src, out, dirs_exist_ok=True)
weights = load_file(src / "adapter_model.safetensors")
for name in weights:
    if "lora_B" not in name:
        continue
    layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
    s = low if layer < split else high
    weights[name] = (weights[name].float() * s).to(weights[name].dtype)
save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
manifest = json.loads((src / "manifest.json").read_text())
manifest["lora_scale"] = 1.0
(out / "manifest.json").write_text(json.dumps(manifest, indent=1))
print("wrote", out, "split", split, "low", low, "high", high)

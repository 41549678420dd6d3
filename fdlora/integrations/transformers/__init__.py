"""fd-lora on Transformers models and PEFT: a load is one read step then one attach step.

    read.py / live.py   PEFT folder, Hub repo or state dict / a live PeftModel -> PeftLoad (checked, nothing changed)
    loraconfig.py       what a LoraConfig decides for one model, answered once as data (read.py asks it)
    params.py           PEFT's LoRA on parameters (ParamWrapper: MoE routers, fused experts): paths, layout, keys
    attach.py           PeftLoads into the model: fused layers, banks, modules_to_save copies (all or nothing)
    api.py              load_fd_lora, from_peft (read -> attach -> enable), save_peft, merge_and_unload, unload
    model.py            FdLoraModel: adapter_names in forward / generate, PEFT's methods, the class switch
    save.py             PEFT-layout writing and merging on the module that holds the layers
    saved_modules.py    modules_to_save as one switch module per path; quantized.py: bitsandbytes checks
"""

from fdlora.integrations.transformers.api import from_peft, load_fd_lora, merge_and_unload, save_peft, unload, unwrap
from fdlora.integrations.transformers.live import adapter_from_peft
from fdlora.integrations.transformers.model import FdLoraModel, disable, enable

__all__ = ["FdLoraModel", "adapter_from_peft", "disable", "enable", "from_peft", "load_fd_lora",
           "merge_and_unload", "save_peft", "unload", "unwrap"]

"""dflash-regen: regenerate a chat dataset with Qwen3.6 on a local SGLang fleet, gate it, publish it."""

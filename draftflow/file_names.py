"""Names of the files stages share, in a module without heavy imports (the progress check loads fast)."""


def file_name(index: int) -> str:
    """A sample's hidden-state file, as speculators names them."""
    return f"hs_{index}.safetensors"

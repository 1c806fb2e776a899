"""Configuration: what the user gave. The TOML file as frozen dataclasses (schema.py), one key
edited in place (edit.py), llama-server's arguments (llama_args.py), the models a folder or
preset holds (models_dir.py), a model file's shape (gguf_meta.py), and replacing a file
atomically (files.py).
"""

"""The applications built on the export pipeline, the top layer below the command line: audit (of the rules in one
export; of a quantization), scan (model sources for patterns that break torch.export), sweep (many corpus models,
locally or on Ray), bench (generation speed per backend, and beside its peers), render (Markdown and HTML reports)
and docgen (the generated docs)."""

"""Models: aliases and fallback chains across models (docs/models.md). Pure: config in, tables out."""

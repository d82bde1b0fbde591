"""Data bundled with sekv-local: ``sample.md``, a sample document to chat with (see
:func:`sekv_local.documents.sample_document`)."""

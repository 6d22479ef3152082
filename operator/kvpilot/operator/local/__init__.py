"""`kvpilot up`: an InferenceModel's rendered fleet as local processes."""

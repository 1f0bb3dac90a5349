"""Model output -> content, reasoning and tool calls, incrementally, on the text the detokenizer
streams: pure parsers, one per format, fed chunk by chunk (a tag may be cut anywhere)."""

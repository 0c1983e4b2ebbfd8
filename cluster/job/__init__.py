"""The batch job behind `kvray run`: streamed input shards, OpenAI batch lines, output records, the
locked output file and resume."""

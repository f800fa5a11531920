"""megatron_app.say writes a whole line in one call: ranks sharing a stream never mix their lines."""

import io

from megatron_app.say import say


class CountingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_a_line_and_its_newline_go_out_in_one_write():
    stream = CountingStream()
    say("megatron_app: rank 0 (pipeline rank 0): schedule policy=planned", stream)
    say("second", stream)
    assert stream.writes == ["megatron_app: rank 0 (pipeline rank 0): schedule policy=planned\n", "second\n"]


def test_print_would_have_split_it():   # why say() exists: print writes the text and the newline separately
    stream = CountingStream()
    print("line", file=stream, flush=True)
    assert stream.writes == ["line", "\n"]


def test_the_default_stream_is_the_current_stderr(capsys):
    say("to stderr")
    assert capsys.readouterr().err == "to stderr\n"

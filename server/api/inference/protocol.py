"""The requests of `/v1/chat/completions` and `/v1/completions`, and their one conversion into the engines'
`SamplingParams` (`to_sampling_params`, as vLLM's protocol models do).

Every field of OpenAI's requests is declared here, in one of two classes: honoured by both engines, or `Unsupported`
(refused with 400 `unsupported_parameter` naming it, unless null or a value that changes nothing here). vLLM's
sampling extensions that its clients send are honoured too (`top_k`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `stream_options.continuous_usage_stats`). Any other field is refused as OpenAI refuses it
("Unrecognized request argument supplied"). A null value is "not given" for every optional field.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    GetCoreSchemaHandler,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from server.api.errors import UNSUPPORTED_PARAMETER
from server.api.schemas import RequestBody
from server.engines.base import SamplingParams
from server.engines.grammar import GrammarError, OutputGrammar
from server.services.inference import ChatPrompt, Prompt, TextPrompt

MAX_N = 16
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 200
MAX_TOP_LOGPROBS = 20  # chat
MAX_LOGPROBS = 5  # OpenAI's limit for text completions
MAX_CHOICES = 64  # choices in one text completion request: prompts x n
MAX_LOGIT_BIAS = 1024  # biased tokens in one request
MAX_BIAS = 100.0
MAX_PENALTY = 2.0
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for text completions


@dataclass(frozen=True)
class Unsupported:
    """Marks a field of OpenAI's request that this server does not honour: null (not given) and the values in
    `no_op` (which change nothing here) pass, anything else is refused with 400 `unsupported_parameter`. `reason`
    completes the error message."""

    reason: str
    no_op: tuple[Any, ...] = ()

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def check(self, value: Any) -> Any:
        # Compared with their types: `0` is not the no-op `false`.
        if value is None or any(type(value) is type(allowed) and value == allowed for allowed in self.no_op):
            return value
        raise PydanticCustomError(UNSUPPORTED_PARAMETER, self.reason)


def _valid_unicode(value: Any) -> Any:
    """JSON may carry lone surrogate escapes ("\\ud800"): they decode to strings no tokenizer or database encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"contains a lone surrogate (\\u{ord(value[error.start]):04x}) at position {error.start}, "
                "which is not valid Unicode"
            ) from None
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    return value


# Request text: a str that is valid Unicode (checked first, so the error says what is wrong).
Text = Annotated[str, BeforeValidator(_valid_unicode)]
# A model name is looked up and recorded: no NUL (PostgreSQL text cannot hold one).
ModelName = Annotated[Text, AfterValidator(_no_nul), Field(min_length=1, max_length=256)]
StopSequence = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
TokenId = Annotated[int, Field(ge=0)]
# Token id (a JSON object's key, so a string of digits) -> bias added to its logit.
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]], Field(max_length=MAX_LOGIT_BIAS)
]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# OpenAI's rule for the names of functions and response formats.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_TOOLS = 128  # OpenAI's limit


class StreamOptions(RequestBody):
    include_usage: bool | None = None
    # vLLM's: every chunk carries the usage so far.
    continuous_usage_stats: bool | None = None
    include_obfuscation: Annotated[Any, Unsupported("streamed chunks carry no obfuscation padding", (False,))] = None


# --- chat messages ----------------------------------------------------------------------------------------------


class TextPart(RequestBody):
    type: Literal["text"]
    text: Text


class FunctionCall(RequestBody):
    name: FunctionName
    arguments: Text  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError as error:
            raise ValueError(f"must be a JSON object: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")
        return arguments


class ToolCall(RequestBody):
    """A call an assistant message made (OpenAI's function tool call)."""

    id: Annotated[Text, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestBody):
    """A message of the conversation, as the model's chat template renders it: a role and text; an assistant's tool
    calls, and the call a tool message answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    tool_call_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None
    name: Annotated[Any, Unsupported("the chat template does not render participant names")] = None
    # An assistant message's other parts, which the chat template does not render.
    refusal: Annotated[Any, Unsupported("the chat template does not render refusals")] = None
    audio: Annotated[Any, Unsupported("this server answers in text only")] = None
    function_call: Annotated[Any, Unsupported("function calls are not available; use tool calls")] = None

    @model_validator(mode="after")
    def _tool_fields_of_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention: a call's arguments as an object)."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# --- structured outputs and tools -------------------------------------------------------------------------------


class TextFormat(RequestBody):
    type: Literal["text"]


class JsonObjectFormat(RequestBody):
    type: Literal["json_object"]


class JsonSchema(RequestBody):
    name: FunctionName
    description: Annotated[Any, Unsupported("the response format's description is not shown to the model")] = None
    # Absent: any JSON value. Enforced whether or not `strict` is true.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(RequestBody):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class FunctionDefinition(RequestBody):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None  # the arguments always match `parameters`, strict or not


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(RequestBody):
    name: FunctionName


class NamedToolChoice(RequestBody):
    """Call this function, once."""

    type: Literal["function"]
    function: ChosenFunction


class AllowedTools(RequestBody):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1)]


class AllowedToolsChoice(RequestBody):
    """Only these of the tools may be called, under `mode`."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


# --- the shared fields ------------------------------------------------------------------------------------------


class SamplingRequest(RequestBody):
    """The fields chat and text completions share, with OpenAI's ranges; `to_sampling_params` is their meaning."""

    model: ModelName
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: StopSequence | list[StopSequence] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Annotated[Any, Unsupported("requests are attributed to their API key")] = None
    # vLLM's sampling extensions.
    top_k: int | None = Field(
        default=None, ge=-1, description="vLLM's: sample from the k most likely tokens (0 or -1: all)"
    )
    min_tokens: int | None = Field(
        default=None, ge=0, description="vLLM's: tokens generated before a stop may end a choice"
    )
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False, description="vLLM's and transformers' repetition penalty"
    )
    ignore_eos: StrictBool | None = Field(default=None, description="vLLM's: generate past end-of-sequence tokens")

    @field_validator("stop")
    @classmethod
    def _few_stop_sequences(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        """A streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the completion's length, for errors about it."""
        return "max_tokens"

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_sampling_params(self, room: int) -> SamplingParams:
        """The engines' parameters for one prompt that leaves `room` tokens of the context for its completion."""
        logprobs = self.logprob_alternatives()
        return SamplingParams(
            max_tokens=self.completion_tokens(room),
            n=self.n or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=self.stop_sequences(),
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            prompt_logprobs=self.prompt_logprobs(),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            logit_bias=dict(self.logit_bias or {}),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            grammar=self.grammar,
        )

    @property
    def grammar(self) -> OutputGrammar | None:
        """The grammar choices are decoded under, if any."""
        return None

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are parsed out of the choices' text."""
        return False

    @abc.abstractmethod
    def completion_tokens(self, room: int) -> int:
        """The most tokens a choice may generate, given `room` left in the context."""

    @abc.abstractmethod
    def logprob_alternatives(self) -> int | None:
        """Alternatives reported with each generated token's logprob; None: no logprobs."""

    def prompt_logprobs(self) -> int | None:
        """Alternatives reported with each prompt token's logprob; None: the prompt is not scored."""
        return None

    @property
    def echo_prompt(self) -> bool:
        """Each choice starts with its prompt."""
        return False

    @abc.abstractmethod
    def prompts(self) -> list[Prompt]:
        """The prompts to complete, each with `n` choices."""


# --- chat completions -------------------------------------------------------------------------------------------


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="Deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    # Structured outputs and tools: held to by constrained decoding (`server.engines.grammar`).
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[Any, Unsupported("function calls are not available; use tools")] = None
    function_call: Annotated[Any, Unsupported("function calls are not available; use tool_choice")] = None
    # Outputs other than text, and features of OpenAI's own service.
    modalities: Annotated[Any, Unsupported("this server answers in text only", (["text"],))] = None
    audio: Annotated[Any, Unsupported("this server answers in text only")] = None
    prediction: Annotated[Any, Unsupported("predicted outputs are not available")] = None
    reasoning_effort: Annotated[Any, Unsupported("the model does not reason before answering", ("none",))] = None
    verbosity: Annotated[Any, Unsupported("the model has no verbosity setting")] = None
    web_search_options: Annotated[Any, Unsupported("web search is not available")] = None
    moderation: Annotated[Any, Unsupported("moderation is not available")] = None
    store: Annotated[Any, Unsupported("completions are not stored for later retrieval", (False,))] = None
    metadata: Annotated[Any, Unsupported("completions are not stored, so they carry no metadata")] = None
    # One service tier: OpenAI's default.
    service_tier: Annotated[Any, Unsupported("there is one service tier", ("auto", "default"))] = None
    prompt_cache_key: Annotated[Any, Unsupported("prompt caching is automatic and takes no key")] = None
    prompt_cache_retention: Annotated[Any, Unsupported("prompt caching has no retention setting")] = None
    prompt_cache_options: Annotated[Any, Unsupported("prompt caching has no options")] = None
    safety_identifier: Annotated[Any, Unsupported("requests are attributed to their API key")] = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    @field_validator("tool_choice")
    @classmethod
    def _names_given_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None or choice == "none":
            return choice
        names = {tool.function.name for tool in info.data.get("tools") or []}
        if not names:
            raise ValueError("needs tools: no tools were given")
        chosen = [choice] if isinstance(choice, NamedToolChoice) else []
        chosen += choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else []
        missing = [named.function.name for named in chosen if named.function.name not in names]
        if missing:
            raise ValueError(f"names {missing[0]!r}, which is not among the tools")
        return choice

    @property
    def parses_tool_calls(self) -> bool:
        """The answer's tool calls are parsed out of its text (`tool_choice` "none" renders tools but never calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @cached_property
    def grammar(self) -> OutputGrammar | None:
        """The grammar the answer is decoded under: its tool calls', or its response format's. Raises
        `GrammarError` for a schema the grammar library cannot build or enforce."""
        response_format = self.response_format
        wants_json = response_format is not None and response_format.type != "text"
        if self.parses_tool_calls:
            if wants_json:
                raise GrammarError(
                    "response_format: a JSON response format cannot be combined with tool calls; use tool_choice "
                    '"none" to answer in JSON',
                    param="response_format",
                )
            tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
            choice = self.tool_choice
            # "none" leaves nothing to parse: only auto, required and named choices get here.
            mode = choice.model_dump() if isinstance(choice, NamedToolChoice | AllowedToolsChoice) else choice
            return OutputGrammar.tool_calls(tools, mode or "auto", parallel=self.parallel_tool_calls is not False)
        if isinstance(response_format, JsonObjectFormat):
            return OutputGrammar.json_object()
        if isinstance(response_format, JsonSchemaFormat):
            schema = response_format.json_schema.schema_
            return OutputGrammar.json_schema({} if schema is None else schema)
        return None

    @property
    def max_tokens_param(self) -> str:
        # `max_completion_tokens` replaces the deprecated `max_tokens`; either names the field in errors.
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def completion_tokens(self, room: int) -> int:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return room if limit is None else limit

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompts(self) -> list[Prompt]:
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        return [ChatPrompt([message.as_template_input() for message in self.messages], tools)]


# --- text completions -------------------------------------------------------------------------------------------

TextPromptValue = Annotated[Text, Field(min_length=1)]
TokenIdsPrompt = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a list of them: each gets `n` choices, indexed prompt by prompt.
    prompt: (
        TextPromptValue
        | TokenIdsPrompt
        | Annotated[list[TextPromptValue], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[TokenIdsPrompt], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    echo: bool | None = None
    # OpenAI's default is 16; 0 scores the prompt without generating (with `echo`).
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[Any, Unsupported("the model does not insert text before a suffix", ("",))] = None
    # One candidate per choice.
    best_of: Annotated[Any, Unsupported("choices are not chosen among candidates; ask for n choices", (1,))] = None

    @field_validator("prompt")
    @classmethod
    def _few_choices(cls, prompt: str | list[int] | list[str] | list[list[int]], info: ValidationInfo) -> Any:
        prompts = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
        if prompts * (info.data.get("n") or 1) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) per request")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _generate_unless_echoing(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("must be at least 1 (0 is allowed with echo, to score the prompt only)")
        return max_tokens

    @property
    def echo_prompt(self) -> bool:
        return bool(self.echo)

    def completion_tokens(self, room: int) -> int:
        return min(DEFAULT_COMPLETION_TOKENS, room) if self.max_tokens is None else self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [TextPrompt(prompt)]
        return [TextPrompt(each) for each in prompt]

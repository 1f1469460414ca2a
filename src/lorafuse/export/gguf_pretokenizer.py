"""Which llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) a Hugging Face tokenizer needs.

llama.cpp re-implements each BPE pre-tokenizer (the regex split before merges) in C++ and picks
it by name; a name it does not know makes it refuse the file ("unknown pre-tokenizer type").
Its converter (``convert_hf_to_gguf.py``, ``get_vocab_base_pre``) cannot read the name off
``tokenizer.json``, so it encodes a fixed text that exercises every split rule, hashes the
token ids (sha256 of ``str(ids)``) and looks the hash up in a table of tokenizers it has
checked. We do the same, in this order:

1. a model converted from a GGUF file (``lorafuse.models.source`` leaves ``lorafuse_source.json``
   naming the file) carries that file's ``tokenizer.ggml.pre`` over unchanged;
2. a sentencepiece-style tokenizer (BPE with byte fallback: Llama 2, Mistral) has no regex
   split: ``"default"``, as the converter's sentencepiece / ``LlamaHfVocab`` paths write;
3. a byte-level BPE tokenizer is identified by the hash of ``CHKTXT`` in ``PRE_BY_HASH``;
4. anything else raises ``GGUFExportError``: guessing from the regex wrote ``"gpt2"`` for
   SmolLM2 (llama.cpp knows ``smollm``), which llama.cpp, Ollama and LM Studio refuse.

Why a hash and not the regex: the same regex with a different vocabulary can need a different
llama.cpp name (SmolLM vs GPT-2), and llama.cpp has only the names it was taught.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

from lorafuse.errors import GGUFExportError
from lorafuse.models.source import SOURCE_MARKER  # written by convert_gguf

# The check text of llama.cpp's get_vocab_base_pre, character for character (a different text
# gives different hashes: it was verified by reproducing the smollm hash from SmolLM2's GGUF vocab).
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f "
    "(multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 "
    "33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f"
    "\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e "
    "------======= \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440"
    "\u0441\u043a\u0438 ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# chkhsh -> llama.cpp pre-tokenizer name, with the model llama.cpp took the hash from. Copied
# from get_vocab_base_pre (an if-chain, so where two entries share a hash the later one wins:
# mpt/olmo -> "olmo", bert-bge/jina-v2-en -> "jina-v2-en"). Add a line only from that function.
PRE_BY_HASH: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-ai/deepseek-llm-7b-base
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-ai/deepseek-coder-6.7b-base
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",  # tiiuae/falcon-7b
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",  # jinaai/jina-embeddings-v2-base-en
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # tiiuae/Falcon3-7B-Base
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",  # BAAI/bge-large-zh-v1.5
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",  # allenai/OLMo-1.7-7B-hf
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # bigcode/starcoder2-3b
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",  # stabilityai/stablelm-2-zephyr-1_6b
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",  # smallcloudai/Refact-1_6-base
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",  # CohereForAI/c4ai-command-r-v01
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # databricks/dbrx-base
    "c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448": "jina-v1-en",  # jinaai/jina-reranker-v1-tiny-en
    "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643": "jina-v2-es",  # jinaai/jina-embeddings-v2-base-es
    "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6": "jina-v2-de",  # jinaai/jina-embeddings-v2-base-de
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # abacusai/Smaug-Llama-3-70B-Instruct
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",  # LumiOpen/Poro-34B-chat
    "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a": "jina-v2-code",  # jinaai/jina-embeddings-v2-base-code
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",  # LumiOpen/Viking-7B
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",  # core42/jais-13b
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",  # WisdomShell/CodeShell-7B
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # mistralai/Mistral-Nemo-Base-2407
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",  # bigscience/bloom
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",  # TurkuNLP/gpt3-finnish-small
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",  # LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # microsoft/phi-2
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",  # facebook/chameleon-7b
    "8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65": "roberta-bpe",  # sentence-transformers/stsb-roberta-base
    "ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb": "gigachat",  # ai-sage/GigaChat-20B-A3B-instruct
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",  # Infinigence/Megrez-3B-Instruct
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # deepseek-ai/DeepSeek-V3
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # Xenova/gpt-4o
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": "superbpe",  # UW/OLMo2-8B-SuperBPE-t180k
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",  # trillionlabs/Trillion-7B-preview
    "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224": "bailingmoe",  # inclusionAI/Ling-lite
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",  # meta-llama/Llama-4-Scout-17B-16E-Instruct
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",  # mistral-community/pixtral-12b
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",  # ByteDance-Seed/Seed-Coder-8B-Base
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",  # THUDM/glm-4-9b-chat
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",  # THUDM/glm-4-9b-chat
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",  # THUDM/glm-4-9b-hf
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",  # sapienzanlp/Minerva-7B-base-v1.0
}
# what llama.cpp writes for tokenizers without a regex split (sentencepiece / byte fallback)
DEFAULT_PRE = "default"
KNOWN_NAMES = frozenset(PRE_BY_HASH.values()) | {DEFAULT_PRE}


def source_gguf_pre(model_dir: str | Path) -> str | None:
    """``tokenizer.ggml.pre`` of the GGUF file ``model_dir`` was converted from (None if not one)."""
    marker = Path(model_dir) / SOURCE_MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text(encoding="utf-8")).get("source") or "")
    if not source.is_file():
        return None
    import gguf

    field = gguf.GGUFReader(source).get_field(gguf.Keys.Tokenizer.PRE)
    return bytes(field.parts[-1]).decode("utf-8") if field is not None else None


def tokenizer_hash(tok_dir: str | Path) -> str:
    """sha256 of the ids ``AutoTokenizer(tok_dir).encode(CHKTXT)``, as llama.cpp's converter computes it."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as err:  # noqa: BLE001 - any loading failure is reported the same way
        raise GGUFExportError(
            f"{tok_dir}: could not load the tokenizer to identify its pre-tokenizer: "
            f"{type(err).__name__}: {err}"
        ) from err
    return sha256(str(list(tok.encode(CHKTXT))).encode()).hexdigest()


def _describe(tok_dir: Path) -> str:
    """The tokenizer.json pre_tokenizer, shortened, for error messages."""
    try:
        pre = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8")).get(
            "pre_tokenizer"
        )
    except (OSError, ValueError):
        return "unreadable tokenizer.json"
    text = json.dumps(pre)
    return text if len(text) <= 160 else text[:157] + "..."


def pre_tokenizer_name(tok_dir: str | Path, kind: str, pre: str | None = None) -> str:
    """The ``tokenizer.ggml.pre`` for the tokenizer in ``tok_dir`` (``kind``: "gpt2" | "llama").

    ``pre`` forces a name (it must be one llama.cpp knows: ``KNOWN_NAMES``). Raises
    ``GGUFExportError`` when the tokenizer cannot be identified.
    """
    tok_dir = Path(tok_dir)
    if pre is not None:
        if pre not in KNOWN_NAMES:
            raise GGUFExportError(
                f"pre-tokenizer {pre!r} is not a llama.cpp name lorafuse knows; choose one of "
                f"{sorted(KNOWN_NAMES)}"
            )
        return pre
    carried = source_gguf_pre(tok_dir)
    if carried:
        return carried
    if kind == "llama":
        return DEFAULT_PRE
    chkhsh = tokenizer_hash(tok_dir)
    name = PRE_BY_HASH.get(chkhsh)
    if name is None:
        raise GGUFExportError(
            f"{tok_dir}: llama.cpp cannot identify this tokenizer's pre-tokenizer "
            f"(tokenizer.json pre_tokenizer {_describe(tok_dir)}; check hash {chkhsh} is not one "
            f"of the {len(PRE_BY_HASH)} tokenizers llama.cpp's converter knows), so llama.cpp, "
            "Ollama and LM Studio would refuse the GGUF file; nothing was written. Export with "
            "--format safetensors and convert that with llama.cpp's convert_hf_to_gguf.py once "
            "it supports this tokenizer, or name the llama.cpp pre-tokenizer that matches: "
            "`lorafuse export --pre-tokenizer NAME` (from Python: write_gguf(..., pre=NAME))."
        )
    return name

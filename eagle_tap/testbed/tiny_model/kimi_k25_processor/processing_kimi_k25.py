"""The tiny Kimi-K2.5's processor: its tokenizer and `KimiK25VisionProcessor`, called as SGLang calls Kimi's.

`processor(text=[prompt], medias=[...])` -> input_ids (the prompt as given: SGLang has already repeated each
`<|media_pad|>` once per image feature), attention_mask, and for images pixel_values and grid_thws.
"""

from __future__ import annotations

from transformers import BatchFeature, ProcessorMixin


class KimiK25Processor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    @property
    def media_processor(self):
        return self.image_processor

    def __call__(self, text=None, medias=None, return_tensors="pt", **kwargs) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text or [])
        encoded = self.tokenizer(texts, return_tensors=return_tensors, add_special_tokens=False)
        data = dict(encoded)
        if medias:
            data |= dict(self.image_processor.preprocess(medias))
        return BatchFeature(data)

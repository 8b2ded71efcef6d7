//! Splitting a GLM reply into its thinking (`reasoning_content`) and its answer (`content`).
//!
//! GLM-5's chat template ends the prompt with `<|assistant|><think>` when thinking is on, so the reply starts
//! inside the thinking block and closes it with `</think>`; with thinking off the prompt ends with `</think>`
//! and the reply is all answer. Older GLM replies open the block themselves (`<think>...</think>answer`),
//! which is also recognised at the very start of a reply. A reply that ends before `</think>` is all thinking.
//! This is the behaviour of vLLM's `glm45` reasoning parser, written from its description.

/// Opens the thinking block.
pub const THINK_START: &str = "<think>";
/// Closes the thinking block.
pub const THINK_END: &str = "</think>";

/// Whether a rendered prompt leaves the model inside an open thinking block (its last tag is `<think>`).
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_START)
}

/// Text of one streamed piece, split by where it belongs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// Thinking text.
    pub reasoning: String,
    /// Answer text.
    pub content: String,
}

/// Streaming splitter: push decoded text as it arrives, get the thinking and answer parts of it. A tail that
/// could still become a tag is held back until the next push (or [`ReasoningSplitter::finish`]).
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    in_reasoning: bool,
    /// Nothing but whitespace has been seen yet (a reply may still open the block itself).
    at_start: bool,
    pending: String,
}

impl ReasoningSplitter {
    /// A splitter for a reply whose prompt opened the thinking block (`starts_in_reasoning`) or not.
    pub fn new(starts_in_reasoning: bool) -> Self {
        Self {
            in_reasoning: starts_in_reasoning,
            at_start: true,
            pending: String::new(),
        }
    }

    /// Whether the text seen so far is inside the thinking block.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Splits `text` (appended to what came before).
    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        loop {
            if self.in_reasoning {
                if let Some(at) = self.pending.find(THINK_END) {
                    out.reasoning.push_str(&self.pending[..at]);
                    self.pending.drain(..at + THINK_END.len());
                    self.in_reasoning = false;
                    self.at_start = false;
                    continue;
                }
                let keep = partial_suffix(&self.pending, THINK_END);
                let ready = self.pending.len() - keep;
                out.reasoning.extend(self.pending.drain(..ready));
                if ready > 0 {
                    self.at_start = false;
                }
                return out;
            }
            if self.at_start {
                let trimmed = self.pending.trim_start();
                if let Some(rest) = trimmed.strip_prefix(THINK_START) {
                    self.pending = rest.to_string();
                    self.in_reasoning = true;
                    self.at_start = false;
                    continue;
                }
                if !trimmed.is_empty() && THINK_START.starts_with(trimmed) {
                    return out; // maybe the start of `<think>`: wait for more
                }
                if trimmed.is_empty() {
                    return out;
                }
                self.at_start = false;
            }
            out.content.push_str(&self.pending);
            self.pending.clear();
            return out;
        }
    }

    /// Flushes what was held back.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.pending);
        if self.in_reasoning {
            Split {
                reasoning: rest,
                content: String::new(),
            }
        } else {
            Split {
                reasoning: String::new(),
                content: rest,
            }
        }
    }
}

/// The whole reply at once: `(reasoning, content)`; reasoning is `None` when the reply has no thinking part.
pub fn split_reasoning(reply: &str, starts_in_reasoning: bool) -> (Option<String>, String) {
    let mut splitter = ReasoningSplitter::new(starts_in_reasoning);
    let mut all = splitter.push(reply);
    let rest = splitter.finish();
    all.reasoning.push_str(&rest.reasoning);
    all.content.push_str(&rest.content);
    let had_reasoning =
        starts_in_reasoning || !all.reasoning.is_empty() || reply.contains(THINK_END);
    (had_reasoning.then_some(all.reasoning), all.content)
}

/// Length of the longest proper prefix of `tag` that `text` ends with.
pub(crate) fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| tag.is_char_boundary(n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_opened_block_is_split_at_the_end_tag_across_pieces() {
        let mut s = ReasoningSplitter::new(true);
        let mut reasoning = String::new();
        let mut content = String::new();
        for piece in ["Let me ", "think.</", "thi", "nk>The ", "answer"] {
            let out = s.push(piece);
            reasoning += &out.reasoning;
            content += &out.content;
        }
        let out = s.finish();
        reasoning += &out.reasoning;
        content += &out.content;
        assert_eq!(reasoning, "Let me think.");
        assert_eq!(content, "The answer");
    }

    #[test]
    fn reply_that_opens_the_block_itself() {
        assert_eq!(
            split_reasoning("<think>plan</think>done", false),
            (Some("plan".into()), "done".into())
        );
        assert_eq!(
            split_reasoning("plain <think> text", false),
            (None, "plain <think> text".into())
        );
        assert_eq!(
            split_reasoning("unfinished", true),
            (Some("unfinished".into()), "".into())
        );
    }

    #[test]
    fn prompt_tail_decides_where_a_reply_starts() {
        assert!(prompt_opens_thinking("<|user|>hi<|assistant|><think>"));
        assert!(!prompt_opens_thinking("<|user|>hi<|assistant|></think>"));
        assert!(!prompt_opens_thinking("<|assistant|><think>a</think>b"));
        assert!(!prompt_opens_thinking("plain text"));
    }
}

//! The model's own chat template (the Jinja text a GGUF keeps in `tokenizer.chat_template`,
//! a Hugging Face directory in tokenizer_config.json), rendered by `minijinja` the way
//! transformers' `apply_chat_template` renders it with Jinja2: blocks trimmed and left-stripped,
//! `messages`, `add_generation_prompt`, `bos_token` and `eos_token` defined, `raise_exception`
//! an error, Python's string methods available.

use minijinja::{context, Environment, ErrorKind, UndefinedBehavior};

use crate::error::{Error, Result};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

fn template_error(e: minijinja::Error) -> Error {
    Error::InvalidArgument(format!("chat template: {e:#}"))
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts the template may use.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Internal(format!("template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::ModelFile(format!("chat template does not compile: {e:#}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The conversation as the model expects it; with `add_generation_prompt`, followed by
    /// the opening of the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self.env.get_template("chat").map_err(template_error)?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| context! { role => &m.role, content => &m.content })
            .collect();
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(template_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn renders_like_jinja2_with_trimmed_blocks() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {{ m['role'] | upper }}: {{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}A:{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t
            .render(&[msg("user", " hi "), msg("assistant", "yo")], true)
            .unwrap();
        assert_eq!(out, "  USER: hi\n  ASSISTANT: yo\n<s>A:");
    }

    #[test]
    fn raise_exception_and_bad_templates_are_errors() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        let err = ChatTemplate::new("{% for %}", "", "")
            .err()
            .expect("refused");
        assert!(err.to_string().contains("does not compile"), "{err}");
    }
}

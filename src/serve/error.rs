//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
//! OpenAI uses for the same cause.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400: the request is malformed or asks for something impossible.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 400 about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::bad_request(message)
        }
    }

    /// 400: the prompt (plus the tokens asked for) does not fit the context.
    pub fn context_length(prompt_tokens: usize, requested: usize, limit: usize) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            param: Some("messages".into()),
            ..Self::bad_request(format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} tokens \
                 ({prompt_tokens} in the messages, {requested} in the completion). Please reduce the length \
                 of the messages or completion.",
                prompt_tokens + requested
            ))
        }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
            )
        }
    }

    /// 404: no such model.
    pub fn unknown_model(model: &str, served: &str) -> Self {
        Self {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist. This server serves `{served}`."),
            )
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("No route for {path}."))
    }

    /// 405.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "Method not allowed on this route.",
        )
    }

    /// 408: the body did not arrive in time.
    pub fn timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "The request body did not arrive in time.",
        )
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("The request body is larger than {limit} bytes."),
        )
    }

    /// 429: the waiting queue is full.
    pub fn queue_full() -> Self {
        Self {
            code: Some("queue_full"),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "The server is at capacity (its waiting queue is full); retry later.",
            )
        }
    }

    /// 503: shutting down.
    pub fn unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "The server is shutting down.",
        )
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// OpenAI's `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            response
                .headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

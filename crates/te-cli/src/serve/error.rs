//! OpenAI-style errors: an HTTP status and the body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A refused or failed request, rendered as OpenAI renders errors.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(param: Option<&str>, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: Some(code),
        }
    }

    /// A 400 for a field of the wrong JSON type.
    pub fn wrong_type(param: &str, expected: &str, got: &serde_json::Value) -> Self {
        Self::invalid(
            Some(param),
            "invalid_type",
            format!(
                "Invalid type for '{param}': expected {expected}, but got {} instead.",
                json_type(got)
            ),
        )
    }

    /// A 400 for a value out of range or not allowed.
    pub fn bad_value(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param), "invalid_value", message)
    }

    /// A 400 for a feature this server does not implement.
    pub fn unsupported(param: &str, what: &str) -> Self {
        Self::invalid(
            Some(param),
            "unsupported_parameter",
            format!("'{param}': {what} is not supported by this server."),
        )
    }

    /// A 400 for a prompt that does not fit the context or the KV pool.
    pub fn too_long(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(param), "context_length_exceeded", message)
    }

    /// Another status, with no param.
    pub fn status(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// The `{"error": ...}` object.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            self.body().to_string(),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// "a string", "an integer", ... for error messages.
pub fn json_type(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a decimal",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_four_openai_fields() {
        let e = ApiError::wrong_type("temperature", "a number", &json!("hot"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let body = e.body();
        let err = &body["error"];
        assert_eq!(err["type"], "invalid_request_error");
        assert_eq!(err["param"], "temperature");
        assert_eq!(err["code"], "invalid_type");
        assert_eq!(
            err["message"],
            "Invalid type for 'temperature': expected a number, but got a string instead."
        );
        let e = ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "bye",
        );
        assert_eq!(e.body()["error"]["param"], serde_json::Value::Null);
    }
}

"""Every route of the chat UI, for app/server.py to mount."""

from . import (attachments, chat_socket, context_notice, exports, login, pages, picker,
               settings_page, tools_panel, uploads, voice)

routes = [*login.routes, *pages.routes, *context_notice.routes, *picker.routes, *chat_socket.routes,
          *tools_panel.routes, *settings_page.routes, *exports.routes, *attachments.routes,
          *uploads.routes, *voice.routes]
